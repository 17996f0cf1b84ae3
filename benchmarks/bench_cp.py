"""Context parallel on a long sequence: step time and memory per rank at CP 1, 2, 4, side by side.

    python benchmarks/bench_cp.py [--flavor debugmodel] [--seq_len 4096] [--steps 3] [--degrees 1,2,4]
        [--out benchmarks/results/cp.json]

Each degree is one torchrun job of CP ranks (one thread each on CPU) training one sequence per step.
Per rank it reports the peak bytes of tensors a training step keeps alive at once (activations,
attention intermediates, gradients: `tessera.memory.LiveBytes`, the same on every device), which
falls as 1/CP, and the process peak (allocator peak on GPU, RSS on CPU), which also holds the runtime.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import smoke_option, write_json  # noqa: E402


def worker(a) -> None:
    """One CP rank: a warm-up step, timed steps, then one step under the live-bytes meter."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from tessera.distributed import init_world, shutdown, world_size_from_env
    from tessera.memory import LiveBytes
    from tessera.metrics import peak_memory_gib
    from tessera.preflight import parse_args, validate
    from tessera.train import train_step
    from tessera.trainer import build_trainer

    with tempfile.TemporaryDirectory() as dump:
        cfg = parse_args(["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len),
                          "--training.local_batch_size", "1", "--training.steps", str(a.steps + 2),
                          "--parallelism.context_parallel_degree", str(world_size_from_env()),
                          "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", dump])
        tr = build_trainer(cfg, init_world(validate(cfg, world_size_from_env())))
        train_step(tr)
        start = time.perf_counter()
        for _ in range(a.steps):
            train_step(tr)
        step_s = (time.perf_counter() - start) / a.steps
        with LiveBytes() as meter:
            train_step(tr)
        live = torch.tensor([meter.peak / 2**30], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(live, op=dist.ReduceOp.MAX)
        if tr.world.rank == 0:
            Path(a.worker).write_text(json.dumps({"step_s": step_s, "live_gib": live.item(),
                                                  "peak_gib": peak_memory_gib(tr.world.device)}))
        tr.metrics.close()
        shutdown(clean=True)


def run(degree: int, a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={degree}",
               __file__, "--worker", str(out), "--flavor", a.flavor, "--seq_len", str(a.seq_len),
               "--steps", str(a.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"CP {degree} failed:\n{proc.stderr[-3000:]}")
        return {"cp": degree, **json.loads(out.read_text())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/cp.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    smoke_option(p, flavor="tiny", seq_len=128, steps=1, degrees="1,2")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    results = [run(int(d), a) for d in a.degrees.split(",")]
    base = results[0]
    print(f"{a.flavor}, seq_len {a.seq_len}, 1 sequence per step, 1 thread per rank")
    print(f"{'CP':>3} {'step s':>8} {'speed-up':>9} {'step memory GiB/rank':>21} {'vs CP 1':>8} "
          f"{'process peak GiB':>17}")
    for r in results:
        r["speedup"], r["memory_ratio"] = base["step_s"] / r["step_s"], r["live_gib"] / base["live_gib"]
        print(f"{r['cp']:>3} {r['step_s']:>8.2f} {r['speedup']:>8.2f}x {r['live_gib']:>21.3f} "
              f"{r['memory_ratio']:>7.2f}x {r['peak_gib']:>17.3f}")
    write_json(a.out, {"flavor": a.flavor, "seq_len": a.seq_len, "results": results})


if __name__ == "__main__":
    main()
