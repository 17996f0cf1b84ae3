"""Context parallel on a long sequence: peak memory per rank and step time at CP 1, 2, 4, side by side.

    python benchmarks/bench_cp.py [--flavor debugmodel] [--seq_len 4096] [--steps 3] [--degrees 1,2,4]
        [--out benchmarks/results/cp.json]

Each degree is one torchrun job of CP ranks (one thread each on CPU) training one sequence per step.
Memory per rank is the peak the trainer reports (allocator peak on GPU, process RSS on CPU); the
activation part of it - what a step adds over the ready-to-train process - should fall as 1/CP.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(degree: int, a) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={degree}",
               "-m", "tessera.train", "--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len),
               "--training.local_batch_size", "1", "--training.steps", str(a.steps), "--metrics.log_freq", "1",
               "--parallelism.context_parallel_degree", str(degree), "--lr_scheduler.warmup_steps", "0",
               "--job.dump_folder", dump]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"CP {degree} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in Path(dump, "metrics.jsonl").read_text().splitlines()]
    first, timed = rows[0], rows[1:] or rows
    step_s = sum(a.seq_len / degree / r["tps"] for r in timed) / len(timed)  # tps counts each token once
    return {"cp": degree, "step_s": step_s, "peak_gib": rows[-1]["memory_gib"], "first_step_gib": first["memory_gib"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/cp.json"))
    a = p.parse_args()
    results = [run(int(d), a) for d in a.degrees.split(",")]
    base = results[0]
    print(f"{a.flavor}, seq_len {a.seq_len}, 1 sequence per step")
    print(f"{'CP':>3} {'step s':>8} {'speed-up':>9} {'peak GiB/rank':>14} {'vs CP 1':>8}")
    for r in results:
        r["speedup"], r["memory_ratio"] = base["step_s"] / r["step_s"], r["peak_gib"] / base["peak_gib"]
        print(f"{r['cp']:>3} {r['step_s']:>8.2f} {r['speedup']:>8.2f}x {r['peak_gib']:>14.3f} {r['memory_ratio']:>7.2f}x")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"flavor": a.flavor, "seq_len": a.seq_len, "results": results}, indent=2))


if __name__ == "__main__":
    main()
