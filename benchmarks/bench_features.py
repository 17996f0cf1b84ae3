"""Speed and memory features, each against its off switch, in one process:

    python benchmarks/bench_features.py [--only compile,ac,float8] [--flavor debugmodel] [--seq_len 256]
        [--local_batch_size 8] [--ac_seq_len 512] [--ac_batch 8] [--steps 10] [--warmup 2] [--rounds 3]
        [--float8_steps 10] [--threads N] [--out benchmarks/results/features.json]

compile: trainer with compile.enable vs without (steps interleaved, median of pairs; first step = compilation).
ac: activation memory of one forward + backward with full / selective-op AC vs none, and the step-time cost.
float8: loss after --float8_steps steps with Float8 linears vs without (emulated on CPU and pre-Ada GPUs, so
only correctness there); on a GPU with float8 also the speed-up, both sides compiled.
See benchmarks/README.md for what each number means.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402, I001
    AC, COMPILE, FLOAT8, RESULTS, alternate, make_trainer, paired_ratio, smoke_option, sync_for, tessera_argv,
    write_json,
)
from tessera.memory import LiveBytes  # noqa: E402
from tessera.step import forward_backward  # noqa: E402
from tessera.train import train_step  # noqa: E402


def compare(a, variants: dict[str, list[str]], seq_len: int, batch: int, rounds: int, warmup: int, steps: int):
    """One trainer per variant (same flags plus its own), their train_steps interleaved."""
    argv = tessera_argv(a.flavor, seq_len, batch, rounds * (warmup + steps) + 1, a.lr)
    trainers = {name: make_trainer(argv + extra) for name, extra in variants.items()}
    runs = {name: (lambda i, t=t: train_step(t)[0]) for name, t in trainers.items()}
    device = next(iter(trainers.values())).world.device
    return trainers, alternate(runs, rounds, warmup, steps, sync_for(device), seq_len * batch)


def activation_bytes(tr) -> int:
    """Peak bytes one forward + backward adds: the allocator's on GPU, live op outputs on CPU (deterministic)."""
    inputs, labels = tr.batch_fn(tr.loader)  # the trainer's own next micro-batch
    if tr.world.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward(tr.step_parts, inputs, labels)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with LiveBytes() as meter:
            forward_backward(tr.step_parts, inputs, labels)
        peak = meter.peak
    tr.optimizer.zero_grad()
    return peak


def bench_compile(a) -> dict:
    _, out = compare(a, {"eager": [], "compiled": COMPILE}, a.seq_len, a.local_batch_size, a.rounds, a.warmup,
                     a.steps)
    speedup = paired_ratio(out, "compiled", "eager")
    gap = abs(out["compiled"]["loss_after_round_1"] - out["eager"]["loss_after_round_1"])
    print(f"  compile speed-up {speedup:.3f}x (target > 1.0); first step {out['compiled']['first_step_s']:.1f}s "
          f"with compilation vs {out['eager']['first_step_s']:.1f}s eager; loss gap {gap:.2e}")
    return {**out, "speedup": speedup, "loss_gap_round_1": gap}


def bench_ac(a) -> dict:
    trainers, out = {}, {}
    argv = tessera_argv(a.flavor, a.ac_seq_len, a.ac_batch, a.rounds * (a.warmup + a.steps) + 2, a.lr)
    for mode, extra in AC.items():  # memory first: one forward + backward each, before any optimizer step
        trainers[mode] = make_trainer(argv + extra)
        out[mode] = {"activation_mib": activation_bytes(trainers[mode]) / 2**20}
    runs = {mode: (lambda i, t=t: train_step(t)[0]) for mode, t in trainers.items()}
    timing = alternate(runs, a.rounds, a.warmup, a.steps, sync_for(trainers["none"].world.device),
                       a.ac_seq_len * a.ac_batch)
    none = out["none"]
    print(f"  AC, seq {a.ac_seq_len} x batch {a.ac_batch}: {'activation MiB':>14} {'vs none':>8} {'tokens/s':>10} "
          f"{'time vs none':>12} {'loss r1':>8}")
    for mode, r in out.items():
        r |= timing[mode]
        r["memory_ratio"] = r["activation_mib"] / none["activation_mib"]
        r["time_ratio"] = paired_ratio(timing, "none", mode)
        r["loss_gap_round_1"] = abs(r["loss_after_round_1"] - timing["none"]["loss_after_round_1"])
        print(f"  {mode:<34} {r['activation_mib']:>14.1f} {r['memory_ratio']:>7.2f}x {r['tokens_per_s']:>10,.0f} "
              f"{r['time_ratio']:>11.2f}x {r['loss_after_round_1']:>8.4f}")
    return out


def bench_float8(a) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    native = device.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    # Emulated: correctness only, one run of --float8_steps steps. Native: a speed comparison too, compiled.
    extra = COMPILE if native else []
    f8 = FLOAT8 + ([] if native else ["--quantize.linear.float8.emulate"])
    rounds, warmup, steps = (a.rounds, a.warmup, a.float8_steps) if native else (1, 0, a.float8_steps)
    _, out = compare(a, {"high_precision": extra, "float8": extra + f8}, a.seq_len, a.local_batch_size,
                     rounds, warmup, steps)
    hp, lp = out["high_precision"], out["float8"]
    gap = abs(lp["loss_after_round_1"] - hp["loss_after_round_1"])
    res = {**out, "emulated": not native, "steps": warmup + steps, "loss_gap": gap,
           "loss_gap_relative": gap / abs(hp["loss_after_round_1"])}
    print(f"  float8 ({'emulated' if not native else 'native'}): loss after {warmup + steps} steps "
          f"{lp['loss_after_round_1']:.4f} vs {hp['loss_after_round_1']:.4f}, gap {gap:.2e} "
          f"({res['loss_gap_relative']:.2%}; target <= 1%)")
    if native:
        res["speedup"] = paired_ratio(out, "float8", "high_precision")
        print(f"  float8 speed-up {res['speedup']:.3f}x (both compiled)")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="compile,ac,float8", help="comma-separated subset of compile, ac, float8")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--local_batch_size", type=int, default=8)
    p.add_argument("--ac_seq_len", type=int, default=512, help="sequence length of the AC runs")
    p.add_argument("--ac_batch", type=int, default=8, help="batch of the AC runs")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each run")
    p.add_argument("--rounds", type=int, default=3, help="rounds of warm-up + timed steps, runs interleaved")
    p.add_argument("--float8_steps", type=int, default=10, help="steps before the float8 loss comparison")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads (CPU)")
    p.add_argument("--out", default=str(RESULTS / "features.json"))
    smoke_option(p, flavor="tiny", seq_len=32, local_batch_size=2, ac_seq_len=64, ac_batch=2, steps=2, warmup=1,
                 rounds=1, float8_steps=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    benches = {"compile": bench_compile, "ac": bench_ac, "float8": bench_float8}
    only = a.only.split(",")
    if unknown := set(only) - set(benches):
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(benches)}")
    res = {"device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
           "flavor": a.flavor, "seq_len": a.seq_len, "local_batch_size": a.local_batch_size, "steps": a.steps,
           "warmup": a.warmup, "rounds": a.rounds, "ac_seq_len": a.ac_seq_len, "ac_batch": a.ac_batch}
    for name in only:
        print(f"\n== {name}", flush=True)
        res[name] = benches[name](a)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
