"""Loss compare: `python -m tessera.loss_compare A B [--steps N] [--overrides "..."] [--a "..."] [--b "..."]`.

A and B are each a TOML config, run here for --steps steps on the same seed and data (metrics logged every step;
--nproc_a / --nproc_b processes each, through tessera.launch), or a finished run's job.dump_folder, read as it
is. Prints the per-step loss of both and their relative difference |A - B| / |A|, writes compare.png and
compare.json in --out, and exits 0 when every step is within --tolerance, 1 when one is not, 2 on bad input:
the check to run before trusting a new layout or feature on a cluster (fp32 layouts agree to ~1e-5; bf16 to
~1e-2).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

from tessera.report import read_run, series


def run_side(source: str, name: str, a: argparse.Namespace, extra: str, nproc: int) -> str:
    """The dump folder holding `source`'s metrics: itself, or where its config was just run."""
    if os.path.isdir(source):
        return source
    if not os.path.isfile(source):
        raise ValueError(f"{source}: neither a TOML config nor a run's dump folder")
    dump = os.path.join(a.out, name)
    if os.path.exists(os.path.join(dump, "metrics.jsonl")):
        raise ValueError(f"{dump} holds an earlier comparison's run; remove it or pick another --out")
    cmd = [sys.executable, "-m", "tessera.launch", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "tessera.train", "--job.config_file", source, "--job.dump_folder", dump, "--training.steps",
           str(a.steps), "--metrics.log_freq", "1", "--checkpoint.enable=false", *shlex.split(a.overrides),
           *shlex.split(extra)]
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env and not _has_gpu():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    print(f"loss_compare: running {name}: {shlex.join(cmd[2:])}", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
        raise RuntimeError(f"run {name} ({source}) failed with exit status {proc.returncode}; its output is above")
    return dump


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def compare(dump_a: str, dump_b: str, tolerance: float) -> dict:
    (steps_a, loss_a), (steps_b, loss_b) = series(read_run(dump_a), "loss"), series(read_run(dump_b), "loss")
    b = dict(zip(steps_b, loss_b, strict=True))
    rows = [(s, la, b[s], abs(la - b[s]) / max(abs(la), 1e-12)) for s, la in zip(steps_a, loss_a, strict=True)
            if s in b]
    if not rows:
        raise ValueError(f"{dump_a} and {dump_b} logged no loss at the same steps")
    worst = max(rows, key=lambda r: r[3])
    over = [r[0] for r in rows if r[3] > tolerance]
    return {"a": dump_a, "b": dump_b, "tolerance": tolerance, "steps": [r[0] for r in rows],
            "loss_a": [r[1] for r in rows], "loss_b": [r[2] for r in rows], "rel_diff": [r[3] for r in rows],
            "max_rel_diff": worst[3], "worst_step": worst[0], "steps_over": over, "passed": not over}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, constrained_layout=True)
    top.plot(result["steps"], result["loss_a"], label=f"A: {result['a']}")
    top.plot(result["steps"], result["loss_b"], "--", label=f"B: {result['b']}")
    top.set_ylabel("loss")
    top.legend()
    bottom.semilogy(result["steps"], [max(d, 1e-12) for d in result["rel_diff"]], marker="o", markersize=3)
    bottom.axhline(result["tolerance"], color="red", linestyle=":", label="tolerance")
    bottom.set_ylabel("|A - B| / |A|")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.loss_compare", description=__doc__.split("\n\n")[1])
    p.add_argument("a", help="TOML config or a run's dump folder")
    p.add_argument("b", help="TOML config or a run's dump folder")
    p.add_argument("--steps", type=int, default=20, help="steps to run each config for")
    p.add_argument("--overrides", default="", help="flags for both runs, e.g. \"--training.seed 1\"")
    p.add_argument("--a", dest="a_flags", default="", help="flags for run A only")
    p.add_argument("--b", dest="b_flags", default="", help="flags for run B only")
    p.add_argument("--nproc_a", type=int, default=1, help="processes for run A")
    p.add_argument("--nproc_b", type=int, default=1, help="processes for run B")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest |A - B| / |A| allowed at any step")
    p.add_argument("--out", default="./outputs/loss_compare", help="folder for the runs, compare.png, compare.json")
    a = p.parse_args(argv)
    try:
        if a.steps < 1 or a.nproc_a < 1 or a.nproc_b < 1 or not a.tolerance >= 0:
            raise ValueError("--steps, --nproc_a and --nproc_b must be >= 1 and --tolerance >= 0")
        dumps = [run_side(src, name, a, flags, n) for src, name, flags, n in
                 ((a.a, "a", a.a_flags, a.nproc_a), (a.b, "b", a.b_flags, a.nproc_b))]
        result = compare(*dumps, a.tolerance)
    except ValueError as e:
        print(f"tessera.loss_compare: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"tessera.loss_compare: {e}", file=sys.stderr)
        return 1
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "compare.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    plot(result, os.path.join(a.out, "compare.png"))
    print("step  loss A      loss B      |A-B|/|A|")
    for s, la, lb, d in zip(result["steps"], result["loss_a"], result["loss_b"], result["rel_diff"], strict=True):
        print(f"{s:>4}  {la:<10.6f}  {lb:<10.6f}  {d:.2e}{'  over' if d > a.tolerance else ''}")
    verdict = "PASS" if result["passed"] else f"FAIL at step(s) {', '.join(map(str, result['steps_over'][:10]))}"
    print(f"{verdict}: max |A-B|/|A| {result['max_rel_diff']:.2e} (step {result['worst_step']}) against tolerance "
          f"{a.tolerance:g}; plot and numbers in {os.path.join(a.out, 'compare.png')}, compare.json")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
