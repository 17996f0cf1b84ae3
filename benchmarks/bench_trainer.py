"""Tessera's trainer against a plain eager PyTorch loop: same model, batch, data and AdamW, in one process.

    python benchmarks/bench_trainer.py [--flavor debugmodel] [--seq_len 256] [--local_batch_size 8] [--steps 20]
        [--warmup 3] [--rounds 3] [--threads N] [--fsdp] [--out benchmarks/results/trainer.json]

Runs alternate (plain, tessera, plain, tessera, ...) and the median over rounds is reported, so background load
hits both sides alike. See benchmarks/README.md for what each number means.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.config import parse_args  # noqa: E402
from tessera.config.validate import validate  # noqa: E402
from tessera.data import build_dataloader, build_tokenizer  # noqa: E402
from tessera.distributed import init_world  # noqa: E402
from tessera.metrics import flops_per_token, measure_gemm_peak  # noqa: E402
from tessera.models.llama3.args import FLAVORS, TAKES_TOKENIZER_VOCAB  # noqa: E402
from tessera.models.llama3.model import Transformer, num_params  # noqa: E402
from tessera.parallel.init import materialize  # noqa: E402
from tessera.train import train_step  # noqa: E402
from tessera.trainer import build_trainer  # noqa: E402


def tessera_argv(a, dump: str, steps: int, log_freq: int) -> list[str]:
    """Trainer flags for the benchmark's config; constant lr (no warmup, no decay) like the plain loop."""
    argv = ["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len),
            "--training.local_batch_size", str(a.local_batch_size), "--training.steps", str(steps),
            "--optimizer.lr", str(a.lr), "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0",
            "--metrics.log_freq", str(log_freq), "--job.dump_folder", dump]
    # On one GPU, "auto" does not enable autocast; ask for bf16 explicitly so both sides compute in bf16.
    return argv + (["--training.mixed_precision_param", "bfloat16"] if torch.cuda.is_available() else [])


def build_plain(cfg, device: torch.device, vocab_size: int):
    """The model and optimizer as a user would write them, from the same flavor table and hyper-parameters."""
    args = dataclasses.replace(FLAVORS[cfg.model.flavor], max_seq_len=cfg.training.seq_len)
    if cfg.model.flavor in TAKES_TOKENIZER_VOCAB:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    model = Transformer(args)
    materialize(model, device, cfg.training.seed)  # same weights as the trainer's
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    return model.train(), opt, args


def plain_step(model, opt, inputs, labels, max_norm: float, autocast) -> torch.Tensor:
    with autocast:
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def timed(step, warmup: int, steps: int, sync) -> tuple[float, float]:
    """(steps per second over `steps` steps after `warmup` untimed ones, loss of the last step)."""
    for i in range(warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
    sync()
    return steps / (time.perf_counter() - start), float(loss)


def launch(a, nproc: int, tokens_per_step: int) -> float:
    """Aggregate tokens/s of the trainer under torchrun with `nproc` ranks at 1 thread each, from metrics.jsonl."""
    log_freq = max(1, a.warmup)
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "tessera.train", *tessera_argv(a, dump, log_freq + a.steps, log_freq)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"torchrun with {nproc} rank(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(Path(dump, "metrics.jsonl")) as fh:
            recs = [r for r in map(json.loads, fh) if "tps" in r]
    # Skip the first logged window (warm-up, FSDP lazy init); weight the rest by their step counts.
    # Each record's tps is rank 0's tokens over its window; ranks step in lockstep, so the aggregate is nproc x it.
    window = [b["step"] - p["step"] for p, b in zip(recs, recs[1:])]
    seconds = sum(w * tokens_per_step / r["tps"] for w, r in zip(window, recs[1:]))
    return nproc * sum(window) * tokens_per_step / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--local_batch_size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each run")
    p.add_argument("--rounds", type=int, default=3, help="alternating plain/tessera rounds; the median is reported")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads (CPU)")
    p.add_argument("--fsdp", action="store_true", help="also measure 2-rank FSDP scaling with torchrun")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/trainer.json"))
    a = p.parse_args()

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # one process, whatever launched us
        os.environ.pop(key, None)
    dump = tempfile.TemporaryDirectory()
    cfg = parse_args(tessera_argv(a, dump.name, a.rounds * (a.warmup + a.steps), 10**9))
    world = init_world(validate(cfg, 1))
    torch.set_num_threads(a.threads)  # after init_world, which picks its own count on CPU
    device, cuda = world.device, world.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gemm_dtype, gemm_n = (torch.bfloat16, 4096) if cuda else (torch.float32, 1024)

    tr = build_trainer(cfg, world)
    tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    model, opt, args = build_plain(cfg, device, tokenizer.vocab_size)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else torch.autocast(device.type, enabled=False)
    fpt = flops_per_token(num_params(model, exclude_embedding=True), args.n_layers, args.n_heads, args.head_dim,
                          a.seq_len)
    assert fpt == tr.flops_per_token, (fpt, tr.flops_per_token)
    # The first warmup + steps batches of the trainer's own data stream, on the device before timing starts.
    loader = build_dataloader(cfg, tokenizer, 0, 1)
    batches = [tuple(x.to(device) for x in loader.next_batch()) for _ in range(a.warmup + a.steps)]
    tokens_per_step = a.local_batch_size * a.seq_len

    runs = {"plain": lambda i: plain_step(model, opt, *batches[i], cfg.training.max_norm, autocast),
            "tessera": lambda i: train_step(tr)[0]}
    tps, losses, peaks = {k: [] for k in runs}, {}, []
    for r in range(a.rounds):
        for name, step in runs.items():
            peaks.append(measure_gemm_peak(device, gemm_dtype, gemm_n))
            steps_per_s, loss = timed(step, a.warmup, a.steps, sync)
            tps[name].append(steps_per_s * tokens_per_step)
            losses.setdefault(name, loss)  # round 1: same weights, data and lr on both sides -> ~equal loss
            print(f"round {r + 1}/{a.rounds}  {name:<8} {tps[name][-1]:>10,.0f} tokens/s  loss {loss:.4f}",
                  flush=True)

    peak = max(peaks)  # load only ever slows a GEMM down: the best sample is the ceiling
    res = {"device": str(device), "threads": torch.get_num_threads(), "flavor": a.flavor,
           "params": num_params(model), "seq_len": a.seq_len, "local_batch_size": a.local_batch_size,
           "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "flops_per_token": fpt,
           "gemm_peak_gflops": peak / 1e9, "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
           "gemm_peak_samples_gflops": [x / 1e9 for x in peaks]}
    for name in runs:
        med = statistics.median(tps[name])
        res[name] = {"tokens_per_s": med, "rounds_tokens_per_s": tps[name], "mfu": med * fpt / peak,
                     "loss_after_round_1": losses[name]}
    res["tessera_over_plain"] = res["tessera"]["tokens_per_s"] / res["plain"]["tokens_per_s"]
    res["loss_gap_round_1"] = abs(losses["tessera"] - losses["plain"])  # ~0 when both take the same steps

    print(f"\n{device.type}, {res['threads']} threads; llama3 {a.flavor} ({res['params'] / 1e6:.2f}M params), "
          f"seq {a.seq_len} x batch {a.local_batch_size}, {a.steps} steps after {a.warmup}, median of {a.rounds} rounds")
    print(f"  GEMM peak ({res['gemm_dtype']}, n={gemm_n})  {res['gemm_peak_gflops']:10.1f} GFLOP/s")
    print(f"  {'':<20} {'tokens/s':>10} {'MFU':>7}  {'loss r1':>8}")
    for name in runs:
        r = res[name]
        print(f"  {name:<20} {r['tokens_per_s']:>10,.0f} {r['mfu']:>7.1%}  {r['loss_after_round_1']:>8.4f}")
    print(f"  tessera / plain      {res['tessera_over_plain']:>10.3f}  (target >= 1.0)")
    print(f"  loss gap, round 1    {res['loss_gap_round_1']:>10.2e}  (same weights, data, lr: expect ~0)")

    if a.fsdp:
        if cuda and torch.cuda.device_count() < 2:
            print("  fsdp: skipped (needs 2 GPUs)")
        else:
            one, two = launch(a, 1, tokens_per_step), launch(a, 2, tokens_per_step)
            res["fsdp"] = {"one_rank_tokens_per_s": one, "two_rank_tokens_per_s": two,
                           "scaling_efficiency": two / (2 * one), "threads_per_rank": 1}
            print(f"  1 rank  x 1 thread   {one:>10,.0f} tokens/s")
            print(f"  2 ranks x 1 thread   {two:>10,.0f} tokens/s (aggregate, FSDP)")
            print(f"  scaling efficiency   {two / (2 * one):>10.3f}  (2-rank / (2 x 1-rank))")

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=2)
    print(f"  -> {a.out}")
    tr.metrics.close()
    dump.cleanup()


if __name__ == "__main__":
    main()
