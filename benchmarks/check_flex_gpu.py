"""The attention kernel on a GPU: FlexAttention (tessera/models/common/attention.py: flex_attend) against the
materialized scores, forward and backward, then side by side in time and memory.

    python benchmarks/check_flex_gpu.py [--seq_len 4096] [--cases a,b] [--out benchmarks/results/flex_gpu.json]

1. Parity, fp32: sliding window + sinks (GPT-OSS), causal + sinks, chunks (Llama 4), packed documents, queries
   that are the last positions of the keys (a context-parallel rank's chunk), heads of 128, MLA's 192-wide heads
   (which `attend` leaves to the blockwise kernel); output and
   the gradients of q, k, v and the sinks, as max |error| / max |reference|. Then a GPT-OSS model, forward and
   backward with each kernel, eager and with its blocks compiled (FlexAttention inside a compiled block).
2. Speed and memory, bf16, one attention layer of GPT-OSS 20b (64 heads, 8 KV heads, head 64, sinks; window 128
   and full) and of Llama 4 (40 heads, 8 KV heads, head 128, chunks of a quarter of the sequence): forward +
   backward time and peak memory above the inputs, each kernel.
Exits 1 when a parity error exceeds 1e-4 (fp32; the kernels sum in other orders).
Without a GPU, `--smoke` checks the forward outputs of the parity cases on CPU (FlexAttention runs eagerly there,
forward only), and skips the model and the timings.
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import smoke_option  # noqa: E402

from tessera.models.common import attention  # noqa: E402

DISPATCH = attention.attend  # on CUDA: flex_attend


def materialized(q, k, v, window=0, chunk=0, scale=None, sinks=None, documents=None, masks=None, **_):
    """The scores as a tensor under the mask (the suite's reference, tests/sparse_reference.py)."""
    from tests.sparse_reference import masked_attention

    return masked_attention(q, k, v, window, chunk, scale, sinks, documents)


def run(kernel, q, k, v, sinks, grad, **kw):
    """[output, then the gradients of q, k, v (and sinks)]; the output alone when `grad` is None."""
    leaves = [t.detach().requires_grad_(grad is not None) for t in (q, k, v)] + \
        ([sinks.detach().requires_grad_(grad is not None)] if sinks is not None else [])
    out = kernel(*leaves[:3], sinks=leaves[3] if sinks is not None else None, **kw)
    if grad is None:
        return [out.detach()]
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def parity_cases(dev, seq, only=None):
    g = torch.Generator(device=dev).manual_seed(0)
    docs = torch.cat([torch.full((n,), i, device=dev) for i, n in enumerate((seq // 3, seq // 2, seq - seq // 3
                                                                               - seq // 2))])[None].repeat(2, 1)
    cases = {"window+sinks": dict(window=128, sink=True), "causal+sinks": dict(sink=True),
             "chunks": dict(chunk=256), "documents+window": dict(window=100, documents=docs),
             "cp_offset_chunks+sinks": dict(chunk=256, sink=True, n_q=seq // 4),
             "head128_chunks": dict(qk=128, vd=128, chunk=256),  # Llama 4's heads
             "mla_offset_falls_back": dict(qk=192, vd=128, n_q=seq // 4, kernel=attention.attend)}
    for name, c in cases.items():
        if only and name not in only:
            continue
        qk, vd, n_q = c.get("qk", 64), c.get("vd", 64), c.get("n_q", seq)
        q = torch.randn(2, 8, n_q, qk, device=dev, generator=g)
        k = torch.randn(2, 2, seq, qk, device=dev, generator=g)
        v = torch.randn(2, 2, seq, vd, device=dev, generator=g)
        sinks = torch.randn(8, device=dev, generator=g) if c.get("sink") else None
        # FlexAttention has a backward only compiled, i.e. on CUDA here
        grad = torch.randn(2, 8, n_q, vd, device=dev, generator=g) if dev == "cuda" else None
        kw = {k_: c[k_] for k_ in ("window", "chunk", "documents") if k_ in c}
        ours = run(c.get("kernel", attention.flex_attend), q, k, v, sinks, grad, **kw)
        ref = run(materialized, q, k, v, sinks, grad, **kw)
        yield name, {n: rel_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), ours, ref,
                                                                  strict=False)}


def model_parity(dev):
    """A GPT-OSS model (windows shorter than the sequence, sinks), fp32: loss and every gradient."""
    from tessera.models import family
    from tessera.parallel.init import materialize

    fam = family("gpt_oss")
    args = dataclasses.replace(fam.flavors["debugmodel"], dim=256, n_heads=8, n_kv_heads=2, head_dim=32, window=64,
                               vocab_size=1024, max_seq_len=512)
    tokens = torch.randint(0, 1024, (2, 513), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    results = {}
    for compiled in (False, True):
        grads = {}
        for kernel in ("flex", "materialized"):
            with torch.device("meta"):
                model = attention.use_attention(fam.spec().model(args), DISPATCH if kernel == "flex" else materialized)
            materialize(model, torch.device(dev), seed=0)
            if compiled:
                for name, block in model.layers.items():
                    model.layers[name] = torch.compile(block)
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            grads[kernel] = {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}
        worst = max(grads["flex"], key=lambda n: rel_err(grads["flex"][n], grads["materialized"][n]))
        results["compiled" if compiled else "eager"] = {
            "loss_err": rel_err(grads["flex"]["loss"], grads["materialized"]["loss"]),
            "worst_grad": worst, "worst_grad_err": rel_err(grads["flex"][worst], grads["materialized"][worst])}
    return results


def speed(dev, seq, heads, head_dim, window=0, chunk=0, sink=True):
    g = torch.Generator(device=dev).manual_seed(2)
    q = torch.randn(1, heads, seq, head_dim, device=dev, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, seq, head_dim, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    sinks, grad = torch.randn(heads, device=dev, generator=g) if sink else None, torch.randn_like(q)
    out = {}
    for name, kernel in (("flex", attention.flex_attend), ("materialized", materialized)):
        try:
            for _ in range(3):
                run(kernel, q, k, v, sinks, grad, window=window, chunk=chunk)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            for _ in range(10):
                run(kernel, q, k, v, sinks, grad, window=window, chunk=chunk)
            torch.cuda.synchronize()
            out[name] = {"ms": (time.perf_counter() - start) * 100,
                         "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2 ** 30}
        except torch.OutOfMemoryError:
            out[name] = {"ms": None, "peak_gib": "OOM"}
        torch.cuda.empty_cache()
    if out["flex"]["ms"] and out["materialized"]["ms"]:
        out["speedup"] = out["materialized"]["ms"] / out["flex"]["ms"]
        out["memory_ratio"] = out["flex"]["peak_gib"] / out["materialized"]["peak_gib"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--cases", default="", help="parity cases to run, comma-separated (default: all)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/flex_gpu.json"))
    smoke_option(p, seq_len=256)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print("no CUDA device: FlexAttention runs only on CUDA here; nothing to check (--smoke: forward parity on CPU)")
        return 0
    dev, ok = ("cuda", True) if cuda else ("cpu", True)
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu", "smoke": a.smoke}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, errs in parity_cases(dev, 1024 if not a.smoke else a.seq_len, [c for c in a.cases.split(",") if c]):
        report[name] = errs
        ok &= max(errs.values()) <= 1e-4
        print(f"parity {name:24s} " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    if not cuda:  # the model needs FlexAttention's backward; the timings, CUDA's memory counters
        out.write_text(json.dumps(report, indent=1))
        print("PASS (forward parity on CPU only)" if ok else "FAIL: a parity error above 1e-4")
        return 0 if ok else 1
    report["model"] = model_parity(dev)
    for mode, r in report["model"].items():
        ok &= max(r["loss_err"], r["worst_grad_err"]) <= 1e-4
        print(f"model  {mode:9s} loss {r['loss_err']:.1e}, worst grad {r['worst_grad']} {r['worst_grad_err']:.1e}",
              flush=True)
    out.write_text(json.dumps(report, indent=1))
    layers = {"gpt_oss_sliding": dict(heads=64, head_dim=64, window=128), "gpt_oss_full": dict(heads=64, head_dim=64),
              "llama4_chunked": dict(heads=40, head_dim=128, chunk=a.seq_len // 4, sink=False)}
    for label, layer in layers.items():
        report[f"speed_{label}"] = r = speed(dev, a.seq_len, **layer)
        print(f"speed  {label:16s} seq {a.seq_len}: " + json.dumps(r), flush=True)
        out.write_text(json.dumps(report, indent=1))
    print("PASS" if ok else "FAIL: a parity error above 1e-4")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
