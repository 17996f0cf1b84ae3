"""Run the trainer in-process (1 rank) or under torchrun (N ranks) and read back its metrics.jsonl."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tiny, fast, and fully deterministic on CPU; tests override what they vary.
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "5", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3", "--training.deterministic",
        "--training.max_norm", "0.5"]  # below the tiny model's grad norms (~0.9): every step clips


def merge(*argvs) -> list[str]:
    """Flag lists joined, a later flag replacing an earlier one of the same key (the CLI itself refuses a key
    given twice): test defaults, then what a test varies."""
    flags: dict[str, list[str]] = {}
    for argv in argvs:
        argv, i = list(argv), 0
        while i < len(argv):
            arg = argv[i]
            has_value = arg.startswith("--") and "=" not in arg and i + 1 < len(argv) \
                and not argv[i + 1].startswith("--")
            key = arg[2:].partition("=")[0] if arg.startswith("--") else f"#{len(flags)}"  # a stray word stays
            flags.pop(key, None)
            flags[key] = argv[i:i + 1 + has_value]
            i += 1 + has_value
    return [a for group in flags.values() for a in group]


def read_metrics(dump: Path) -> list[dict]:
    with open(dump / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if '"validation/' not in line]


def run_local(dump: Path, *args: str) -> list[dict]:
    """One process, in this interpreter (no torchrun start-up cost)."""
    from tessera.train import main

    env_backup = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        assert main(merge(TINY, ["--job.dump_folder", str(dump)], args)) == 0
    finally:
        os.environ.update(env_backup)
    return read_metrics(dump)


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tessera.train", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_dist(nproc: int, dump: Path, *args: str) -> list[dict]:
    proc = torchrun(nproc, *merge(TINY, ["--job.dump_folder", str(dump)], args))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(dump)


def run_cases(nproc: int, tmp: Path, cases: list[list[str]], steps: int = 5, mode: str = "grads",
              timeout: int = 600) -> list[dict]:
    """Several training cases in ONE torchrun launch (start-up dominates); see tests/dist_worker.py."""
    import torch

    out = tmp / "results.pt"
    flat = [a for case in cases for a in ("--", *case)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "dist_worker.py"), str(out), str(steps), mode, *flat]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def assert_matches(got: dict, ref: dict, tol: float, what: tuple[str, ...] = ("grads",)) -> None:
    """Per-step losses and global grad norms, and step-1 gradients and/or final parameters, equal the
    reference within `tol` (relative to max(1, |ref|) for the per-step series)."""
    import torch

    for series in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(got.get(series, []), ref.get(series, []), strict=True)):
            assert abs(a - b) <= tol * max(1.0, abs(b)), f"step {step + 1}: {series} {a} vs reference {b}"
    for key in what:
        assert got[key].keys() == ref[key].keys()
        for name, g in got[key].items():
            torch.testing.assert_close(g, ref[key][name], rtol=tol, atol=tol,
                                       msg=lambda m, k=key, n=name: f"{k} {n}: {m}")


def resume_copy(src, dst, keep_through: int):
    """A copy of a finished run's dump folder that holds only checkpoints up to `keep_through`."""
    shutil.copytree(src, dst)
    for folder in (dst / "checkpoint", dst / "checkpoint" / "exports"):
        for name in os.listdir(folder) if folder.is_dir() else ():
            if name.startswith("step-") and int(name.split("-")[1]) > keep_through:
                shutil.rmtree(folder / name)
    return dst
