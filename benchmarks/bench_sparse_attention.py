"""Sparse attention against dense attention, one layer each, forward + backward while training, side by side in one
run at each sequence length: dense MLA (DeepSeek V3's, SDPA), DeepSeek V3.2's DSA (the lightning indexer and top-k
MLA, its KL loss attached; tessera/models/deepseek/dsa.py), and DeepSeek V4's compressed sparse (CSA: entries of 4
tokens, the indexer's top-k of them, its loss attached) and heavily compressed (HCA: entries of 128 tokens, all)
attention beside a 128-token window (tessera/models/deepseek/v4/attention.py).

    python benchmarks/bench_sparse_attention.py [--seqs 4096,8192,16384,32768,65536] [--topk 512] [--rounds 1]
        [--layers dense,dsa,csa,hca] [--out ...json]

Per length: tokens/s of each layer (median over rounds, the layers timed in alternation), the bytes each keeps for
backward (tensors autograd saves) per token, and their ratios to dense MLA; then each layer's bytes per token at the
longest length over its figure at the shortest (memory linear in the sequence: 1). On CPU in fp32, 512-wide layers
of 4 heads: MLA's 64 + 32 RoPE dims (values 96, so that dense attention runs SDPA's fused kernel), query and KV
bottlenecks of 128; V4's one key/value head of 96 (32 RoPE), a query bottleneck of 128, 2 output groups of 128;
both indexers 4 heads of 64. DSA and CSA run Tessera's torch path (tessera/models/common/blockwise.py and
sparse.py): the top-k a block of queries at a time, attention over the selected keys gathered per block, no
[queries x keys] tensor.
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

LAYERS = ("dense", "dsa", "csa", "hca")


def _layers(a, device, dtype) -> dict:
    import torch

    from tessera.models.deepseek.args import DeepSeekV3Args
    from tessera.models.deepseek.mla import MLA
    from tessera.models.deepseek.v4.args import CSA, HCA, DeepSeekV4Args
    from tessera.models.deepseek.v4.attention import V4Attention

    mla = DeepSeekV3Args(dim=a.dim, n_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                         qk_rope_head_dim=32, v_head_dim=96)  # values as wide as keys: SDPA's fused kernel on CPU
    v4 = DeepSeekV4Args(dim=a.dim, n_layers=2, n_heads=4, head_dim=96, rope_head_dim=32, q_lora_rank=128, o_groups=2,
                        o_lora_rank=128, window=a.window, layer_types=[CSA, HCA], csa_rate=4, hca_rate=a.hca_rate,
                        index_n_heads=4, index_head_dim=64, index_topk=a.topk)
    torch.manual_seed(0)
    layers = {"dense": MLA(mla), "dsa": MLA(dataclasses.replace(mla, index_topk=a.topk, index_n_heads=4,
                                                                  index_head_dim=64)),
              "csa": V4Attention(v4, 0), "hca": V4Attention(v4, 1)}
    for layer in layers.values():
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
    layers["dsa"].indexer_loss.weight = layers["csa"].indexer_loss.weight = 1.0
    return {name: layer.to(device, dtype).train() for name, layer in layers.items()}


def _ropes(seq: int, a, device) -> dict:
    """MLA's table [seq, 2, 32]; V4's two [seq, 2, 2, 32] (the sliding blocks', the compressed blocks')."""
    import torch

    from tessera.models.common.rope import inv_freq, rope_table

    positions = torch.arange(seq, device=device)
    mla = rope_table(positions, inv_freq(32, 1e4))
    v4 = torch.stack([mla, rope_table(positions, inv_freq(32, 1.6e5))], dim=1)
    return {"dense": mla, "dsa": mla, "csa": v4, "hca": v4}


def at_length(seq: int, a, layers: dict, device, dtype, warm_up: bool) -> dict:
    import torch

    x = torch.randn(1, seq, a.dim, device=device, dtype=dtype, requires_grad=True)
    ropes = _ropes(seq, a, device)
    run = layers
    if warm_up:
        short = a.topk + 2 * a.hca_rate
        for name, layer in run.items():
            measure(layer, x[:, :short], ropes[name][:short])
    times, saved = {name: [] for name in run}, {}
    for _ in range(a.rounds):
        for name, layer in run.items():
            seconds, saved[name] = measure(layer, x, ropes[name])
            times[name].append(seconds)
    out = {"seq": seq, **{f"{n}_tokens_s": seq / statistics.median(t) for n, t in times.items()},
           **{f"{n}_saved_mib": b / 2**20 for n, b in saved.items()},
           **{f"{n}_saved_bytes_per_token": b / seq for n, b in saved.items()}}
    cells = []
    for name in (n for n in LAYERS if n in run):
        if name != "dense" and "dense" in run:
            out[f"{name}_over_dense_speed"] = out[f"{name}_tokens_s"] / out["dense_tokens_s"]
            out[f"{name}_over_dense_memory"] = saved[name] / saved["dense"]
        cells.append(f"{name} {out[f'{name}_tokens_s']:>8,.0f} tok/s {out[f'{name}_saved_mib']:>7.1f} MiB")
    print(f"  seq {seq:>6}: " + " | ".join(cells))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="4096,8192,16384,32768,65536", help="sequence lengths, comma-separated")
    p.add_argument("--layers", default=",".join(LAYERS), help="which of dense, dsa, csa, hca to run")
    p.add_argument("--topk", type=int, default=512, help="keys (DSA) or entries (CSA) each query attends")
    p.add_argument("--window", type=int, default=128, help="V4's sliding window")
    p.add_argument("--hca_rate", type=int, default=128, help="tokens per HCA entry")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/sparse_attention.json"))
    smoke_option(p, seqs="96,160", topk=8, window=16, hca_rate=16, rounds=1, dim=64)
    a = p.parse_args()
    device, dtype = layer_device()
    layers = {n: layer for n, layer in _layers(a, device, dtype).items() if n in a.layers.split(",")}
    print(f"one layer, forward + backward, batch 1, {device.type} {dtype}, width {a.dim}, top-k {a.topk}, "
          f"V4 window {a.window}, HCA rate {a.hca_rate}:")
    rows = [at_length(int(s), a, layers, device, dtype, i == 0) for i, s in enumerate(a.seqs.split(","))]
    growth = {n: rows[-1][f"{n}_saved_bytes_per_token"] / rows[0][f"{n}_saved_bytes_per_token"] for n in layers}
    print(f"bytes kept per token, {rows[-1]['seq']} over {rows[0]['seq']} tokens: "
          + " | ".join(f"{n} {g:.2f}x" for n, g in growth.items()))
    write_json(a.out, {"device": device.type, "dtype": str(dtype), "dim": a.dim, "topk": a.topk, "lengths": rows,
                       "per_token_growth": growth})


if __name__ == "__main__":
    main()
