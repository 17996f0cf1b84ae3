"""DeepSeek V3.2's sparse attention (DSA: the lightning indexer and top-k MLA, tessera/models/deepseek/dsa.py)
against dense MLA (V3's, SDPA), one layer each, forward + backward while training (the indexer's KL loss
attached), side by side in one run at each sequence length.

    python benchmarks/bench_dsa.py [--seqs 2048,4096,8192] [--topk 512] [--rounds 2] [--out ...json]

Per length: tokens/s of each layer (median over rounds, the two timed in alternation) and the bytes each keeps for
backward (tensors autograd saves), and their ratios. On CPU in fp32, a 512-wide layer: 4 heads (64 + 32 RoPE dims,
values 64), query and KV bottlenecks of 128; the indexer 4 heads of 64. Tessera's DSA is a reference path that
materializes the scores and masks [sequence x sequence]: this measures what it costs against dense attention's
fused kernel, the baseline a sparse kernel has to beat.
"""

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_deltanet import measure  # noqa: E402
from common import layer_device, smoke_option, write_json  # noqa: E402


def _layers(a, device, dtype):
    import torch

    from tessera.models.deepseek.args import DeepSeekV3Args
    from tessera.models.deepseek.mla import MLA

    args = DeepSeekV3Args(dim=a.dim, n_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                          qk_rope_head_dim=32, v_head_dim=64)
    torch.manual_seed(0)
    dense, sparse = MLA(args), MLA(dataclasses.replace(args, index_topk=a.topk, index_n_heads=4, index_head_dim=64))
    for layer in (dense, sparse):
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
    sparse.indexer_loss.weight = 1.0
    return dense.to(device, dtype).train(), sparse.to(device, dtype).train()


def at_length(seq: int, a, dense, sparse, device, dtype, warm_up: bool) -> dict:
    import torch

    from tessera.models.common.rope import inv_freq, rope_table

    x = torch.randn(1, seq, a.dim, device=device, dtype=dtype, requires_grad=True)
    rope = rope_table(torch.arange(seq, device=device), inv_freq(32, 1e4))
    layers = {"dense": dense, "dsa": sparse}
    times, saved = {name: [] for name in layers}, {}
    if warm_up:
        for layer in layers.values():
            measure(layer, x[:, :a.topk + 64], rope[:a.topk + 64])
    for _ in range(a.rounds):
        for name, layer in layers.items():
            seconds, saved[name] = measure(layer, x, rope)
            times[name].append(seconds)
    out = {"seq": seq, **{f"{n}_tokens_s": seq / statistics.median(t) for n, t in times.items()},
           **{f"{n}_saved_mib": b / 2**20 for n, b in saved.items()}}
    out["dsa_over_dense_speed"] = out["dsa_tokens_s"] / out["dense_tokens_s"]
    out["dsa_over_dense_memory"] = saved["dsa"] / saved["dense"]
    print(f"  seq {seq:>6}: dense MLA {out['dense_tokens_s']:>9,.0f} tokens/s {out['dense_saved_mib']:>8.1f} MiB | "
          f"DSA {out['dsa_tokens_s']:>9,.0f} tokens/s {out['dsa_saved_mib']:>8.1f} MiB | DSA / dense: speed "
          f"{out['dsa_over_dense_speed']:.2f}x, memory {out['dsa_over_dense_memory']:.2f}x")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="2048,4096,8192", help="sequence lengths, comma-separated")
    p.add_argument("--topk", type=int, default=512, help="keys each query attends (index_topk)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/dsa.json"))
    smoke_option(p, seqs="96,160", topk=32, rounds=1, dim=64)
    a = p.parse_args()
    device, dtype = layer_device()
    dense, sparse = _layers(a, device, dtype)
    print(f"one layer, forward + backward, batch 1, {device.type} {dtype}, width {a.dim}, top-k {a.topk}:")
    rows = [at_length(int(s), a, dense, sparse, device, dtype, i == 0) for i, s in enumerate(a.seqs.split(","))]
    write_json(a.out, {"device": device.type, "dtype": str(dtype), "dim": a.dim, "topk": a.topk, "lengths": rows})


if __name__ == "__main__":
    main()
