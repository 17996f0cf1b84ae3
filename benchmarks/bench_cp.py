"""Context parallel on long sequences: all-gather vs Ulysses at CP 1, 2, 4, side by side in one run.

    python benchmarks/bench_cp.py [--model llama3] [--flavor debugmodel] [--seq_lens 2048,4096,8192,16384]
        [--steps 2] [--degrees 1,2,4] [--methods allgather,ulysses] [--out benchmarks/results/cp.json]

With `--model qwen3_5` (Gated DeltaNet hybrid: 3 of 4 blocks DeltaNet) or `--model kimi_linear` (KDA hybrid) all-gather
CP runs the linear-attention blocks by state passing and Ulysses by head groups, so the two methods of linear
attention are side by side.

Each (sequence length, degree, method) is one torchrun job of CP ranks (one thread each on CPU) training one
sequence per step. Per rank it reports tokens/s of the job, the peak bytes of tensors a training step keeps alive
at once (activations, attention intermediates, gradients: `tessera.memory.LiveBytes`, the same on every device),
the process peak (allocator peak on GPU, RSS on CPU, which also holds the runtime), and the bytes a rank sends
for context-parallel attention in a step: the forward's collectives counted as they run (all-gather: the input to
each other rank; all-to-all: (CP - 1) / CP of it), doubled for the backward, whose reduce-scatters and all-to-alls
move as much.
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


def sent_bytes_counter(ranks: int):
    """A dispatch mode adding up the bytes this rank sends in all-gathers and all-to-alls."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class SentBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name.startswith("c10d::allgather_"):  # (outputs, inputs, ...)
                self.total += sum(t.nbytes for t in args[1]) * (ranks - 1)
            elif name.startswith("c10d::alltoall_base_"):  # (output, input, ...)
                self.total += args[1].nbytes * (ranks - 1) // ranks
            elif name.startswith("_c10d_functional::all_to_all_single"):  # (input, ...)
                self.total += args[0].nbytes * (ranks - 1) // ranks
            return func(*args, **(kwargs or {}))

    del torch
    return SentBytes()


def worker(a) -> None:
    """One CP rank: a warm-up step, timed steps, then one step under the live-bytes meter and the byte counter
    (entered around each attention kernel's forward)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from tessera.distributed import init_world, shutdown, world_size_from_env
    from tessera.memory import LiveBytes
    from tessera.metrics import peak_memory_gib
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tessera.train import train_step
    from tessera.trainer import build_trainer

    ranks = world_size_from_env()
    with tempfile.TemporaryDirectory() as dump:
        cfg = parse_args(["--model.name", a.model, "--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len),
                          "--training.local_batch_size", "1", "--training.steps", str(a.steps + 2),
                          "--parallelism.context_parallel_degree", str(ranks),
                          "--parallelism.context_parallel_method", a.method,
                          "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", dump])
        run = validate(cfg, ranks)
        tr = build_trainer(run, init_world(run.dims))
        train_step(tr)
        start = time.perf_counter()
        for _ in range(a.steps):
            train_step(tr)
        step_s = (time.perf_counter() - start) / a.steps
        counter = sent_bytes_counter(ranks)

        def enter(*_):
            counter.__enter__()

        def leave(*_):
            counter.__exit__(None, None, None)

        kernels = [getattr(block.attention, "sdpa", None) or block.attention.rule  # attention's, or DeltaNet's
                   for block in tr.step_parts.model.layers.values()]
        hooks = [h for kernel in kernels for h in (kernel.register_forward_pre_hook(enter),
                                                    kernel.register_forward_hook(leave))]
        with LiveBytes() as meter:
            train_step(tr)
        for hook in hooks:
            hook.remove()
        live = torch.tensor([meter.peak / 2**30, 2 * counter.total / 2**30], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(live, op=dist.ReduceOp.MAX)
        if tr.world.rank == 0:
            Path(a.worker).write_text(json.dumps({"step_s": step_s, "tokens_per_s": a.seq_len / step_s,
                                                  "live_gib": live[0].item(), "sent_gib": live[1].item(),
                                                  "peak_gib": peak_memory_gib(tr.world.device)}))
        tr.metrics.close()
        shutdown(clean=True)


def run(degree: int, method: str, seq_len: int, a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={degree}",
               __file__, "--worker", str(out), "--model", a.model, "--flavor", a.flavor, "--seq_len", str(seq_len),
               "--steps", str(a.steps), "--method", method]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"CP {degree} ({method}, seq {seq_len}) failed:\n{proc.stderr[-3000:]}")
        return {"cp": degree, "method": method, "seq_len": seq_len, **json.loads(out.read_text())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3", help="model.name (qwen3_5, kimi_linear: linear-attention hybrids)")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_lens", default="2048,4096,8192,16384")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--methods", default="allgather,ulysses")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/cp.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--seq_len", type=int, help="one sequence length instead of --seq_lens")
    p.add_argument("--method", help=argparse.SUPPRESS)  # a worker's
    smoke_option(p, flavor="tiny", seq_lens="128", steps=1, degrees="2")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    results = []
    print(f"{a.model} {a.flavor}, 1 sequence per step, 1 thread per rank; memory and bytes sent per rank")
    print(f"{'seq':>6} {'CP':>3} {'method':>10} {'tokens/s':>9} {'speed-up':>9} {'step memory GiB':>16} "
          f"{'vs CP 1':>8} {'sent MiB/step':>14} {'process peak GiB':>17}")
    lengths = [a.seq_len] if a.seq_len else [int(s) for s in a.seq_lens.split(",")]
    for seq_len in lengths:
        base = None
        for degree in (int(d) for d in a.degrees.split(",")):
            for method in a.methods.split(",") if degree > 1 else ["allgather"]:
                r = run(degree, method, seq_len, a)
                base = base or r
                r["speedup"], r["memory_ratio"] = base["step_s"] / r["step_s"], r["live_gib"] / base["live_gib"]
                print(f"{seq_len:>6} {degree:>3} {method if degree > 1 else '-':>10} {r['tokens_per_s']:>9,.0f} "
                      f"{r['speedup']:>8.2f}x {r['live_gib']:>16.3f} {r['memory_ratio']:>7.2f}x "
                      f"{r['sent_gib'] * 1024:>14.2f} {r['peak_gib']:>17.3f}", flush=True)
                results.append(r)
    write_json(a.out, {"model": a.model, "flavor": a.flavor, "seq_len": lengths[0], "results": results})


if __name__ == "__main__":
    main()
