"""Gated DeltaNet (Qwen 3.5's linear attention, chunked torch path) against full causal attention (Qwen 3.5's gated
attention, SDPA), one layer each, forward + backward, side by side in one run at each sequence length.

    python benchmarks/bench_deltanet.py [--seqs 2048,8192,32768] [--rounds 2] [--chunk 64] [--out ...json]

Per length: tokens/s of each layer (median over rounds, the two timed in alternation) and the bytes each keeps
for backward (the tensors autograd saves, summed: the layer's activation memory), and their ratios. On CPU in
fp32 with a 512-wide layer (attention: 4 heads of 128, 2 KV heads, RoPE on a quarter; DeltaNet: 4 key and 4 value
heads of 128, a 4-tap convolution). On CUDA (bf16) the fla kernels (when flash-linear-attention is installed) are
timed against the torch chunked path too.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import layer_device, smoke_option, write_json  # noqa: E402


def _layers(a, device, dtype):
    import torch

    from tessera.models.common.deltanet import GatedDeltaNet
    from tessera.models.qwen3_5.model import GatedAttention

    torch.manual_seed(0)
    attention = GatedAttention(a.dim, 4, 2, 128, 32, 1e-6)
    deltanet = GatedDeltaNet(a.dim, 4, 4, 128, 128, 4, 1e-6)
    for layer in (attention, deltanet):
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
    deltanet.chunk_size, deltanet.kernel = a.chunk, "torch"
    return attention.to(device, dtype), deltanet.to(device, dtype)


def _rope(seq: int, device):
    import torch

    from tessera.models.common.rope import inv_freq, rope_table

    return rope_table(torch.arange(seq, device=device), inv_freq(32, 1e7))


def measure(layer, x, rope) -> tuple[float, int]:
    """(seconds, bytes saved for backward) of one forward + backward."""
    import torch

    saved = {}  # storage -> bytes: views of one tensor count once

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, rope)
    out.float().square().mean().backward()
    sync()
    return time.perf_counter() - start, sum(saved.values())


def at_length(seq: int, a, attention, deltanet, device, dtype, warm_up: bool) -> dict:
    import torch

    from tessera.models.common.deltanet import fla_available

    x = torch.randn(1, seq, a.dim, device=device, dtype=dtype, requires_grad=True)
    rope = _rope(seq, device)
    layers = {"attention": attention, "deltanet": deltanet}
    if fla_available(device):
        fla = _layers(a, device, dtype)[1]
        fla.load_state_dict(deltanet.state_dict())
        fla.kernel = "fla"
        layers["deltanet_fla"] = fla
    times = {name: [] for name in layers}
    saved = {}
    if warm_up:  # first calls' one-off costs (allocator, kernels), once at the first length
        for layer in layers.values():
            measure(layer, x[:, :128], rope)
    for _ in range(a.rounds):
        for name, layer in layers.items():
            seconds, saved[name] = measure(layer, x, rope)
            times[name].append(seconds)
    out = {"seq": seq, **{f"{n}_tokens_s": seq / statistics.median(t) for n, t in times.items()},
           **{f"{n}_saved_mib": b / 2**20 for n, b in saved.items()}}
    out["deltanet_over_attention_speed"] = out["deltanet_tokens_s"] / out["attention_tokens_s"]
    out["deltanet_over_attention_memory"] = saved["deltanet"] / saved["attention"]
    if "deltanet_fla" in layers:
        out["fla_over_torch_speed"] = out["deltanet_fla_tokens_s"] / out["deltanet_tokens_s"]
    print(f"  seq {seq:>6}: attention {out['attention_tokens_s']:>9,.0f} tokens/s {out['attention_saved_mib']:>8.1f} "
          f"MiB | DeltaNet {out['deltanet_tokens_s']:>9,.0f} tokens/s {out['deltanet_saved_mib']:>8.1f} MiB | "
          f"DeltaNet / attention: speed {out['deltanet_over_attention_speed']:.2f}x, memory "
          f"{out['deltanet_over_attention_memory']:.2f}x"
          + (f" | fla / torch {out['fla_over_torch_speed']:.2f}x" if "fla_over_torch_speed" in out else ""))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="2048,8192,32768", help="sequence lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=64, help="the chunked DeltaNet's chunk size")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/deltanet.json"))
    smoke_option(p, seqs="128,256", rounds=1, dim=64)
    a = p.parse_args()
    device, dtype = layer_device()
    attention, deltanet = _layers(a, device, dtype)
    print(f"one layer, forward + backward, batch 1, {device.type} {dtype}, width {a.dim}, chunk {a.chunk}:")
    rows = [at_length(int(s), a, attention, deltanet, device, dtype, i == 0) for i, s in enumerate(a.seqs.split(","))]
    write_json(a.out, {"device": device.type, "dtype": str(dtype), "dim": a.dim, "chunk": a.chunk, "lengths": rows})


if __name__ == "__main__":
    main()
