"""Loss compare: `python -m tessera.loss_compare A B [--steps N] [--overrides "..."] [--a "..."] [--b "..."]`.

A and B are each a TOML config, run here for --steps steps on the same seed and data (metrics logged every step;
--nproc_a / --nproc_b processes each, through tessera.launch), or a finished run's job.dump_folder, read as it
is. Prints the per-step loss of both and their relative difference |A - B| / |A|, writes compare.png and
compare.json in --out, and exits 0 when every step is within --tolerance, 1 when one is not, 2 on bad input:
the check to run before trusting a new layout or feature on a cluster (fp32 layouts agree to ~1e-5; bf16 to
~1e-2). Both sides train the same global batch, so that a step takes the same samples on both: a side whose
batch follows its layout (global_batch_size = -1) accumulates up to one both layouts reach, said in one line.
"""

import argparse
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys

from tessera.report import read_run, series


def side_argv(source: str, dump: str, a: argparse.Namespace, extra: str) -> list[str]:
    """tessera.train's flags for one side: its config, the shared and its own overrides."""
    return ["--job.config_file", source, "--job.dump_folder", dump, "--training.steps", str(a.steps),
            "--metrics.log_freq", "1", "--checkpoint.enable=false", *shlex.split(a.overrides), *shlex.split(extra)]


def hold_like_with_like(sides: list[tuple[str, list[str], int]]) -> list[list[str]]:
    """Flags that make the sides (name, argv, processes) train the same global batch, so that each step takes the
    same samples on both. A side whose global batch follows its layout (global_batch_size = -1: local batch x
    data-parallel degree) takes the smallest that both layouts can accumulate to, named in one line; two that
    were given different ones are refused in one line. Different data settings are named in a line too."""
    from tessera.preflight import validate
    from tessera.preflight.resume import data_differences
    from tessera.schema import parse_args

    found = []
    for name, argv, nproc in sides:
        try:
            cfg = parse_args(argv)
            dims = validate(cfg, nproc).dims
        except ValueError as e:
            raise ValueError(f"run {name}: {e}") from None
        t = cfg.training
        found.append((name, t, t.local_batch_size * dims.dp))
    (_, ta, pa), (_, tb, pb) = found
    ga, gb = (t.global_batch_size if t.global_batch_size != -1 else p for _, t, p in found)
    for key, va, vb in data_differences(dataclasses.asdict(ta), dataclasses.asdict(tb)):
        print(f"loss_compare: A and B read different data (training.{key} {va!r} and {vb!r}): their losses differ "
              f"by that too", flush=True)
    if ga == gb:
        return [[], []]
    fixed = {t.global_batch_size for _, t, _ in found if t.global_batch_size != -1}
    target = math.lcm(pa, pb, *fixed)
    if len(fixed) == 2 or target not in (fixed or {target}):
        raise ValueError(f"A trains a global batch of {ga} sequences a step and B one of {gb}, so a step of one is "
                         f"not a step of the other; give both one --training.global_batch_size (in --overrides), a "
                         f"multiple of {pa} (A's local batch x data-parallel degree) and of {pb} (B's)")
    print(f"loss_compare: A would train a global batch of {ga} sequences a step and B one of {gb}; both train "
          f"{target} (--training.global_batch_size {target}; a layout below it accumulates) to compare like with "
          f"like", flush=True)
    return [[] if t.global_batch_size != -1 else ["--training.global_batch_size", str(target)] for _, t, _ in found]


def run_side(name: str, argv: list[str], nproc: int) -> None:
    """Runs one side's config (its argv from side_argv) through tessera.launch."""
    cmd = [sys.executable, "-m", "tessera.launch", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "tessera.train", *argv]
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env and not _has_gpu():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    print(f"loss_compare: running {name}: {shlex.join(cmd[2:])}", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
        raise RuntimeError(f"run {name} failed with exit status {proc.returncode}; its output is above")


def run_sides(a: argparse.Namespace) -> list[str]:
    """The dump folder of each side: a finished run's, read as it is, or where its config was just run."""
    sides = []
    for source, name, extra, nproc in ((a.a, "a", a.a_flags, a.nproc_a), (a.b, "b", a.b_flags, a.nproc_b)):
        if os.path.isdir(source):
            sides.append((source, None, nproc))
            continue
        if not os.path.isfile(source):
            raise ValueError(f"{source}: neither a TOML config nor a run's dump folder")
        dump = os.path.join(a.out, name)
        if os.path.exists(os.path.join(dump, "metrics.jsonl")):
            raise ValueError(f"{dump} holds an earlier comparison's run; remove it or pick another --out")
        sides.append((dump, side_argv(source, dump, a, extra), nproc))
    if all(argv is not None for _, argv, _ in sides):  # a finished run is compared as it ran
        held = hold_like_with_like([(name, argv, nproc) for name, (_, argv, nproc) in zip("AB", sides, strict=True)])
        sides = [(dump, argv + more, nproc) for (dump, argv, nproc), more in zip(sides, held, strict=True)]
    for name, (_, argv, nproc) in zip("ab", sides, strict=True):
        if argv is not None:
            run_side(name, argv, nproc)
    return [dump for dump, _, _ in sides]


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
        result = compare(*run_sides(a), a.tolerance)
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
