"""Tessera's trainer against a plain eager PyTorch loop: same model, batch, data and AdamW, in one process.

    python benchmarks/bench_trainer.py [--flavor debugmodel] [--seq_len 256] [--local_batch_size 8] [--steps 20]
        [--warmup 3] [--rounds 3] [--threads N] [--compile] [--fsdp] [--out benchmarks/results/trainer.json]

Runs take turns step by step (plain, tessera[, tessera compiled], plain, ...); ratios are medians of
back-to-back step pairs, so background load hits every side alike. See benchmarks/README.md for what each number means.
"""

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402, I001
    COMPILE, RESULTS, ROOT, alternate, child_env, gemm_setup, make_trainer, paired_ratio, smoke_option, sync_for,
    tessera_argv, write_json,
)
from tessera.data import build_dataloader, build_tokenizer  # noqa: E402
from tessera.metrics import measure_gemm_peak  # noqa: E402
from tessera.models.llama3.args import FLAVORS, TAKES_TOKENIZER_VOCAB  # noqa: E402
from tessera.models import family, num_params  # noqa: E402
from tessera.models.common.decoder import Decoder as Transformer  # noqa: E402
from tessera.parallel.init import materialize  # noqa: E402
from tessera.train import train_step  # noqa: E402


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


def launch(a, nproc: int, tokens_per_step: int) -> float:
    """Aggregate tokens/s of the trainer under torchrun with `nproc` ranks at 1 thread each, from metrics.jsonl."""
    log_freq = max(1, a.warmup)
    with tempfile.TemporaryDirectory() as dump:
        env = child_env(OMP_NUM_THREADS="1")
        argv = tessera_argv(a.flavor, a.seq_len, a.local_batch_size, log_freq + a.steps, a.lr, log_freq, dump)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "tessera.train", *argv]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"torchrun with {nproc} rank(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(Path(dump, "metrics.jsonl")) as fh:
            recs = [r for r in map(json.loads, fh) if "tps" in r]
    # Skip the first logged window (warm-up, FSDP lazy init); weight the rest by their step counts.
    # Each record's tps is rank 0's tokens over its window; ranks step in lockstep, so the aggregate is nproc x it.
    window = [b["step"] - p["step"] for p, b in zip(recs, recs[1:], strict=False)]
    seconds = sum(w * tokens_per_step / r["tps"] for w, r in zip(window, recs[1:], strict=True))
    return nproc * sum(window) * tokens_per_step / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--local_batch_size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each run")
    p.add_argument("--rounds", type=int, default=3, help="rounds of warm-up + timed steps, runs interleaved")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads (CPU)")
    p.add_argument("--compile", action="store_true", help="also run the trainer with compile.enable in the rounds")
    p.add_argument("--fsdp", action="store_true", help="also measure 2-rank FSDP scaling with torchrun")
    p.add_argument("--out", default=str(RESULTS / "trainer.json"))
    # (compilation's smoke is bench_features.py's: the same trainer flag)
    smoke_option(p, flavor="tiny", seq_len=32, local_batch_size=2, steps=2, warmup=1, rounds=1, fsdp=True)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    argv = tessera_argv(a.flavor, a.seq_len, a.local_batch_size, a.rounds * (a.warmup + a.steps), a.lr)
    trainers = {"tessera": make_trainer(argv)}
    if a.compile:
        trainers["tessera_compiled"] = make_trainer(argv + COMPILE)
    tr = trainers["tessera"]
    cfg, device = tr.cfg, tr.world.device
    cuda, sync = device.type == "cuda", sync_for(device)
    gemm_dtype, gemm_n = gemm_setup(device)
    tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    model, opt, args = build_plain(cfg, device, tokenizer.vocab_size)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else torch.autocast(device.type, enabled=False)
    counts = family("llama3").counts(args, a.seq_len)
    assert counts.params == num_params(model), (counts.params, num_params(model))
    fpt = counts.flops_per_token
    # The plain loop gets the first warmup + steps batches of the trainer's own data stream, on the device already.
    loader = build_dataloader(cfg, tokenizer, 0, 1)
    batches = [tuple(x.to(device) for x in loader.next_batch()) for _ in range(a.warmup + a.steps)]
    tokens_per_step = a.local_batch_size * a.seq_len

    runs = {"plain": lambda i: plain_step(model, opt, *batches[i], cfg.training.max_norm, autocast)}
    runs |= {name: (lambda i, t=t: train_step(t)[0]) for name, t in trainers.items()}
    peaks = []
    out = alternate(runs, a.rounds, a.warmup, a.steps, sync, tokens_per_step,
                    before_each_round=lambda: peaks.append(measure_gemm_peak(device, gemm_dtype, gemm_n)))
    peak = max(peaks)  # load only ever slows a GEMM down: the best sample is the ceiling
    res = {"device": str(device), "threads": torch.get_num_threads(), "flavor": a.flavor,
           "params": num_params(model), "seq_len": a.seq_len, "local_batch_size": a.local_batch_size,
           "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "flops_per_token": fpt,
           "gemm_peak_gflops": peak / 1e9, "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
           "gemm_peak_samples_gflops": [x / 1e9 for x in peaks]}
    for name, r in out.items():
        res[name] = {**r, "mfu": r["tokens_per_s"] * fpt / peak,
                     "loss_gap_round_1": abs(r["loss_after_round_1"] - out["plain"]["loss_after_round_1"])}
    ratios = {"tessera_over_plain": ("tessera", "plain", ">= 1.0"),
              "compiled_over_plain": ("tessera_compiled", "plain", ">= 1.3"),
              "compile_speedup": ("tessera_compiled", "tessera", "> 1.0")}
    ratios = {k: v for k, v in ratios.items() if v[0] in out}
    for key, (num, den, _) in ratios.items():
        res[key] = paired_ratio(out, num, den)

    print(f"\n{device.type}, {res['threads']} threads; llama3 {a.flavor} ({res['params'] / 1e6:.2f}M params), "
          f"seq {a.seq_len} x batch {a.local_batch_size}, {a.steps} steps after {a.warmup}, {a.rounds} rounds, "
          f"steps interleaved")
    print(f"  GEMM peak ({res['gemm_dtype']}, n={gemm_n})  {res['gemm_peak_gflops']:10.1f} GFLOP/s")
    print(f"  {'':<20} {'tokens/s':>10} {'MFU':>7}  {'loss r1':>8} {'gap vs plain':>12} {'1st step s':>10}")
    for name in out:
        r = res[name]
        print(f"  {name:<20} {r['tokens_per_s']:>10,.0f} {r['mfu']:>7.1%}  {r['loss_after_round_1']:>8.4f} "
              f"{r['loss_gap_round_1']:>12.2e} {r['first_step_s']:>10.2f}")
    for key, (num, den, target) in ratios.items():
        print(f"  {num} / {den}".ljust(38) + f"{res[key]:>7.3f}  (target {target})")
    print("  loss gap: |loss - plain's| after round 1 (same weights, data, lr): expect ~0; 1st step s: round 1's "
          "first step, compilation included")

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
    write_json(a.out, res)
    for t in trainers.values():
        t.metrics.close()


if __name__ == "__main__":
    main()
