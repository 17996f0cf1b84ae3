"""Muon against AdamW, side by side in one run: (a) the training loss each reaches after the same tokens on a
debug model and the built-in corpus, each at the best learning rate of a small grid; (b) the optimizer step's
time and the share of it spent communicating under FSDP 2 and 4.

    python benchmarks/bench_optim.py [--flavor tiny] [--steps 300] [--lrs 1e-3,3e-3,1e-2,3e-2,1e-1]
                                     [--fsdp 2,4] [--out benchmarks/results/optim.json]

(a) llama3 `--flavor`, one process, the same seed and data for every run; the loss reached is the mean training
loss of the last 10% of steps (WSD schedule: warm-up 10%, decay over the last 20%). Muon's update is scaled to
AdamW's RMS (optimizer.muon_update_scale = match_rms_adamw), so both share one lr grid.
(b) The same model under torchrun at FSDP n, one thread per rank: seconds per optimizer.step() (the slowest
rank's), and on rank 0 the profiler's all-to-all time (Muon gathers each matrix to one rank and scatters it back;
AdamW steps on its shards without communicating).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import run_worker, smoke_option, write_json  # noqa: E402

COMM_EVENTS = ("gloo:all_to_all", "nccl:all_to_all", "gloo:all_reduce", "nccl:all_reduce")
OPTIMIZERS = {"AdamW": ["--optimizer.name", "AdamW"], "Muon": ["--optimizer.name", "Muon"]}


def flags(a, name: str, lr: float, steps: int) -> list[str]:
    return ["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len), "--training.local_batch_size",
            str(a.batch), "--training.steps", str(steps), "--optimizer.lr", str(lr), "--lr_scheduler.warmup_steps",
            str(max(1, steps // 10)), "--lr_scheduler.decay_ratio", "0.2", "--metrics.log_freq", "1000000",
            *OPTIMIZERS[name]]


def loss_grid(a) -> dict:
    from common import make_trainer

    from tessera.train import train_step

    out = {}
    for name in OPTIMIZERS:
        for lr in [float(x) for x in a.lrs.split(",")]:
            tr = make_trainer(flags(a, name, lr, a.steps))
            losses = []
            for _ in range(a.steps):
                loss = train_step(tr)[0]
                tr.progress.step += 1
                losses.append(float(loss))
            tr.metrics.close()
            tail = losses[-max(1, a.steps // 10):]
            out.setdefault(name, {})[str(lr)] = statistics.mean(tail)
            print(f"{name} lr {lr:g}: loss {out[name][str(lr)]:.4f} after {a.steps * a.batch * a.seq_len:,} tokens",
                  flush=True)
    best = {name: min(grid.items(), key=lambda kv: kv[1]) for name, grid in out.items()}
    return {"tokens": a.steps * a.batch * a.seq_len, "grid": out,
            "best": {name: {"lr": float(lr), "loss": loss} for name, (lr, loss) in best.items()}}


def timing(optimizer) -> list[float]:
    """Times each optimizer.step() from here on, all ranks starting together; returns the list it fills."""
    import torch.distributed as dist

    step, seconds = optimizer.step, []

    def timed_step(*args, **kwargs):
        dist.barrier()
        start = time.perf_counter()
        out = step(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out

    optimizer.step = timed_step
    return seconds


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from tessera.distributed import init_world, shutdown, world_size_from_env
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tessera.train import train_step
    from tessera.trainer import build_trainer

    result = {}
    for name in OPTIMIZERS:
        with tempfile.TemporaryDirectory() as dump:
            cfg = parse_args([*flags(a, name, 1e-3, a.timed + 2), "--job.dump_folder", dump])
            run = validate(cfg, world_size_from_env())
            tr = build_trainer(run, init_world(run.dims))
            seconds = timing(tr.optimizer)
            train_step(tr)  # the first step learns each matrix's layout: untimed
            seconds.clear()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                for _ in range(a.timed):
                    train_step(tr)
            slowest = torch.tensor(statistics.median(seconds))
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            comm_s = sum(e.cpu_time_total for e in prof.key_averages()
                         if e.key in COMM_EVENTS and "all_to_all" in e.key) / 1e6 / a.timed
            result[name] = {"step_s": float(slowest), "comm_s": comm_s, "comm_share": comm_s / float(slowest)}
            tr.metrics.close()
    if dist.get_rank() == 0:
        Path(a.worker).write_text(json.dumps(result))
    shutdown(clean=True)


def fsdp_times(ranks: int, a) -> dict:
    return run_worker(__file__, ranks, ["--flavor", a.flavor, "--seq_len", str(a.seq_len), "--batch", str(a.batch),
                                        "--timed", str(a.timed)], f"FSDP {ranks}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny", help="llama3 flavor (debugmodel: 20x the compute per token)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1", help="the learning-rate grid, for both optimizers")
    p.add_argument("--fsdp", default="2,4", help="FSDP degrees timed (each on as many ranks); empty = none")
    p.add_argument("--timed", type=int, default=5, help="optimizer steps timed per FSDP run")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/optim.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    smoke_option(p, flavor="tiny", steps=4, seq_len=32, batch=2, lrs="3e-3", fsdp="2", timed=2)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    result = {"model": f"llama3 {a.flavor}", "loss": loss_grid(a), "fsdp": []}
    for best in result["loss"]["best"].items():
        print(f"best {best[0]}: lr {best[1]['lr']:g}, loss {best[1]['loss']:.4f}")
    for ranks in [int(d) for d in a.fsdp.split(",") if d]:
        times = fsdp_times(ranks, a)
        result["fsdp"].append({"ranks": ranks, **times})
        print(f"FSDP {ranks}: optimizer step " + ", ".join(
            f"{name} {t['step_s'] * 1e3:.1f} ms ({t['comm_share']:.0%} all-to-all)" for name, t in times.items()))
    write_json(a.out, result)


if __name__ == "__main__":
    main()
