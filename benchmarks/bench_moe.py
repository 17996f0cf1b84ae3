"""Mixture of experts: the MoE layer's grouped GEMMs against its per-expert loop, and expert parallelism's
token dispatch as a share of the training step at EP 2 and 4, side by side in one run.

    python benchmarks/bench_moe.py [--tokens 4096] [--rounds 5] [--ep 2,4] [--out benchmarks/results/moe.json]

Layer: forward + backward of one MoE layer on `--tokens` tokens, the grouped path (torch._grouped_mm) and the
loop (one matmul per expert) with the same weights, timed in alternation; on CPU in fp32 with a 256-wide layer
of 16 experts (top 2, hidden 512), on CUDA in bf16 with a Qwen 3 30B-A3B layer (2048 wide, 128 experts, top 8,
hidden 768). EP: the Qwen 3 MoE debug model trained under torchrun, one thread per rank, at EP n (FSDP n for
the dense part) and at FSDP n without EP; on rank 0 the profiler sums the time of the all-to-alls (dispatch,
combine, the count exchange; forward and backward) against the step's.
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

# The backends' own spans of an all-to-all: from its start to the data being there (the wait on peers included).
A2A_EVENTS = ("gloo:all_to_all", "nccl:all_to_all")


def layer_rounds(a) -> dict:
    import torch

    from tessera.models.common.moe import MoE
    from tessera.models.common.moe_args import MoEArgs

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    dim, args = (2048, MoEArgs(128, 8, 768)) if cuda else (256, MoEArgs(16, 2, 512))
    torch.manual_seed(0)
    grouped = MoE(dim, args, grouped=True).to(device, dtype)
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=0.02)
    loop = MoE(dim, args, grouped=False).to(device, dtype)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(1, a.tokens, dim, device=device, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(layer) -> float:
        sync()
        start = time.perf_counter()
        layer(x).float().square().mean().backward()
        sync()
        return time.perf_counter() - start

    times = {"grouped": [], "loop": []}
    for _ in range(2):  # warm-up
        step(grouped), step(loop)
    for _ in range(a.rounds):
        for name, layer in (("grouped", grouped), ("loop", loop)):
            times[name].append(step(layer))
    ratios = [lo / gr for gr, lo in zip(times["grouped"], times["loop"], strict=True)]
    out = {"device": device, "dtype": str(dtype), "dim": dim, "experts": args.n_experts, "top_k": args.top_k,
           "hidden": args.hidden, "tokens": a.tokens,
           **{f"{n}_tokens_s": a.tokens / statistics.median(t) for n, t in times.items()},
           "grouped_over_loop": statistics.median(ratios)}
    print(f"MoE layer on {device} ({dtype}), dim {dim}, {args.n_experts} experts top {args.top_k}, hidden "
          f"{args.hidden}, {a.tokens} tokens, forward + backward:")
    print(f"  grouped {out['grouped_tokens_s']:,.0f} tokens/s, loop {out['loop_tokens_s']:,.0f} tokens/s, grouped / "
          f"loop {out['grouped_over_loop']:.2f}x")
    return out


def worker(a) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tessera.distributed import init_world, shutdown, world_size_from_env
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tessera.train import train_step
    from tessera.trainer import build_trainer

    with tempfile.TemporaryDirectory() as dump:
        cfg = parse_args(["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--training.seq_len",
                          str(a.seq_len), "--training.local_batch_size", "2", "--training.steps", str(a.steps + 2),
                          "--parallelism.expert_parallel_degree", str(a.worker_ep), "--lr_scheduler.warmup_steps",
                          "0", "--job.dump_folder", dump])
        run = validate(cfg, world_size_from_env())
        tr = build_trainer(run, init_world(run.dims))
        train_step(tr)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(a.steps):
                train_step(tr)
            step_s = (time.perf_counter() - start) / a.steps
        a2a_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key in A2A_EVENTS)
        if tr.world.rank == 0:
            Path(a.worker).write_text(json.dumps({"step_s": step_s, "all_to_all_s": a2a_us / 1e6 / a.steps}))
        tr.metrics.close()
        shutdown(clean=True)


def run(ranks: int, ep: int, a) -> dict:
    return run_worker(__file__, ranks, ["--worker_ep", str(ep), "--seq_len", str(a.seq_len), "--steps", str(a.steps)],
                      f"{ranks} ranks, EP {ep}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ep", default="2,4", help="EP degrees (each on as many ranks); empty = layer only")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/moe.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker_ep", type=int, default=1, help=argparse.SUPPRESS)
    smoke_option(p, tokens=128, rounds=1, ep="2", seq_len=64, steps=1)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    result = {"layer": layer_rounds(a), "ep": []}
    for degree in [int(d) for d in a.ep.split(",") if d]:
        with_ep, without = run(degree, degree, a), run(degree, 1, a)
        row = {"ranks": degree, "ep_step_s": with_ep["step_s"], "fsdp_step_s": without["step_s"],
               "dispatch_share": with_ep["all_to_all_s"] / with_ep["step_s"],
               "ep_over_fsdp_speed": without["step_s"] / with_ep["step_s"]}
        result["ep"].append(row)
        print(f"EP {degree} on {degree} ranks (debugmodel_moe, 2 x {a.seq_len} tokens per rank): step "
              f"{row['ep_step_s']:.3f} s, all-to-all {row['dispatch_share']:.1%} of it; FSDP {degree} without EP "
              f"{row['fsdp_step_s']:.3f} s (EP speed / FSDP speed {row['ep_over_fsdp_speed']:.2f}x)")
    write_json(a.out, result)


if __name__ == "__main__":
    main()
