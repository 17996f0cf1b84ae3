"""Run report: `python -m tessera.report DUMP_FOLDER [DUMP_FOLDER ...] [--out DIR]`.

Reads each folder's metrics.jsonl and draws loss (with validation loss), learning rate, grad norm, tokens/s, MFU
and memory against steps, and a panel per task of the in-loop evaluation (its metrics), the runs overlaid, into
report.png, with report.md beside it (a table per run): in the first folder, or --out. The trainer writes one for
its own folder at the end of a run.
"""

import argparse
import json
import logging
import math
import os
import sys

log = logging.getLogger("tessera")

PANELS = (("loss", "loss (dashed: validation)"), ("lr", "learning rate"), ("grad_norm", "grad norm"),
          ("tps", "tokens/s per device"), ("mfu", "MFU"), ("memory_gib", "peak memory (GiB)"))


def read_run(folder: str) -> dict[int, dict]:
    """step -> metrics; a step logged again (a run resumed from an earlier checkpoint) keeps its latest values."""
    path = os.path.join(folder, "metrics.jsonl")
    steps: dict[int, dict] = {}
    try:
        with open(path) as fh:
            for n, line in enumerate(fh, 1):
                try:
                    record = json.loads(line)
                    steps.setdefault(int(record.pop("step")), {}).update(record)
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise ValueError(f"{path} line {n}: not a metrics record ({line.strip()[:60]!r})") from None
    except FileNotFoundError:
        raise ValueError(f"{folder}: no metrics.jsonl; is it a run's job.dump_folder?") from None
    if not steps:
        raise ValueError(f"{path}: no step logged yet")
    return dict(sorted(steps.items()))


def series(run: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    points = [(s, m[key]) for s, m in run.items() if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    return [s for s, _ in points], [v for _, v in points]


def summary(name: str, run: dict[int, dict]) -> list[str]:
    def last(key):
        return series(run, key)[1][-1:] or [float("nan")]

    def mean(key):
        values = series(run, key)[1]
        return sum(values) / len(values) if values else float("nan")

    val = series(run, "validation/loss")[1]
    return [f"| {name} | {max(run)} | {last('loss')[0]:.4f} | {min(val) if val else float('nan'):.4f} | "
            f"{mean('tps'):,.0f} | {mean('mfu'):.1%} | {max(series(run, 'memory_gib')[1] or [float('nan')]):.2f} |"]


def replica_summary(name: str, run: dict[int, dict]) -> list[str]:
    """Fault tolerance's counts (tessera/ft/replicas.py: metrics), for a run that has them."""
    quorum = series(run, "ft/quorum")[1]
    if not quorum:
        return []
    last = run[max(s for s in run if "ft/quorum" in run[s])]
    sync = last.get  # runs from before these counts have none
    return [f"| {name} | {min(quorum):.0f} | {last['ft/recoveries']} | {last['ft/recovery_s']:.2f} | "
            f"{last['ft/degraded_steps']} | {last['ft/uncommitted_steps'] + sync('ft/failed_syncs', 0)} | "
            f"{sync('ft/syncs', 0)} | {sync('ft/mb_per_sync', 0.0):.2f} | "
            f"{sync('ft/sync_bytes_per_token', 0.0):,.0f} | {sync('ft/sync_s', 0.0):.2f} |"]


def eval_tasks(runs: dict[str, dict[int, dict]]) -> dict[str, list[str]]:
    """{task: its metrics} of the in-loop evaluation's `eval/<task>/<metric>` (tessera.eval.loop)."""
    tasks: dict[str, list[str]] = {}
    for run in runs.values():
        for metrics in run.values():
            for key in metrics:
                if key.startswith("eval/") and key.count("/") >= 2:
                    task, metric = key.removeprefix("eval/").rsplit("/", 1)
                    tasks.setdefault(task, [])
                    if metric not in tasks[task]:
                        tasks[task].append(metric)
    return tasks


def _label(ax, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def write_report(folders: list[str], out: str | None = None) -> str | None:
    """report.png and report.md in `out` (default: the first folder); their path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no report.png: matplotlib is not installed (pip install matplotlib)")
        return None
    runs = {os.path.basename(os.path.normpath(f)) or f: read_run(f) for f in folders}
    out = out or folders[0]
    tasks = eval_tasks(runs)
    rows = 2 + math.ceil(len(tasks) / 3)
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4 * rows), constrained_layout=True, squeeze=False)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=False):
        for i, (name, run) in enumerate(runs.items()):
            color = f"C{i}"
            ax.plot(*series(run, key), color=color, label=name)
            if key == "loss" and series(run, "validation/loss")[0]:
                ax.plot(*series(run, "validation/loss"), color=color, linestyle="--", marker="o", markersize=3)
        _label(ax, title)
    for ax, (task, metrics) in zip(axes.flat[len(PANELS):], tasks.items(), strict=False):
        for i, name in enumerate(runs):  # one panel per task: its metrics, a line style each, across steps
            for style, metric in zip(("-", "--", ":", "-."), metrics, strict=False):
                ax.plot(*series(runs[name], f"eval/{task}/{metric}"), color=f"C{i}", linestyle=style, marker="o",
                        markersize=3, label=f"{metric}" if len(runs) == 1 else f"{name} {metric}")
        _label(ax, f"eval: {task}")
        ax.legend(fontsize="small")
    for ax in axes.flat[len(PANELS) + len(tasks):]:
        ax.set_visible(False)
    axes.flat[0].legend()
    os.makedirs(out, exist_ok=True)
    png = os.path.join(out, "report.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    rows = [line for name, run in runs.items() for line in summary(name, run)]
    replicas = [line for name, run in runs.items() for line in replica_summary(name, run)]
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write("| run | steps | final loss | best validation loss | mean tokens/s | mean MFU | peak GiB |\n"
                 "| --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n\n")
        if replicas:
            fh.write("| run (fault tolerance) | smallest quorum | recoveries | seconds recovering | steps committed "
                     "with fewer groups | steps (or syncs) not committed | syncs | MB per sync (a rank) | bytes "
                     "per token | seconds syncing |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
                     + "\n".join(replicas) + "\n\n")
        fh.write("![report](report.png)\n")
    log.info(f"report: {png} and report.md")
    return png


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.report", description=__doc__.split("\n\n")[1])
    p.add_argument("folders", nargs="+", help="runs' job.dump_folder")
    p.add_argument("--out", default=None, help="where report.png and report.md go (default: the first folder)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = write_report(a.folders, a.out)
    except (ValueError, OSError) as e:
        print(f"tessera.report: {e}", file=sys.stderr)
        return 2
    return 0 if path else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
