"""Gated DeltaNet's chunked delta rule, forward + backward, in the two implementations bench_gpu_moe.py compares:
Tessera's torch path (`deltanet.chunk_gated_delta_rule`, the family's `kernel = "torch"`) and fla's Triton kernel
(`fla.ops.gated_delta_rule.chunk_gated_delta_rule`, package fla-core, `kernel = "fla"`), called as the mixer calls
them, on Qwen 3.5 9B's shape: 32 value heads (its 16 key heads repeated, as the mixer does), key and value dims 128,
one sequence. Inputs as fla's own layer makes them: q, k (L2-normed), v and beta in bf16, the log decay g in fp32
(CPU dry runs: all fp32). Loss: sum(out * a fixed random tensor), so every output element has its own gradient.
Per kernel: tokens/s of the median step, `peak_gib` above what was allocated before its first step. fla against the
torch path: for the output and the gradients of q, k, v, g and beta, |fla - torch| / |torch| (norms over the whole
tensor); `equal` when every one is within BF16_TOL."""

import importlib.util

import torch
import torch.nn.functional as F
from gpu_moe_layer import guarded, timed_steps

from tessera.models.common.deltanet import chunk_gated_delta_rule, l2norm

SHAPE = (32, 128, 128)  # value heads, key dim, value dim: Qwen 3.5 9B's linear-attention layers
SMOKE_SHAPE = (2, 16, 16)
# The bar of fla's own tests of this kernel (their error ratio: RMS of the difference / RMS of the reference, 0.02
# for the gate's gradient, the loosest); here both sides read the same bf16 inputs.
BF16_TOL = 2e-2
INPUTS = ("q", "k", "v", "g", "beta")


def torch_kernel(q, k, v, g, beta, chunk_size: int) -> torch.Tensor:
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size)[0]


def fla_kernel(q, k, v, g, beta, chunk_size: int) -> torch.Tensor:  # fla's kernels fix their own chunk size
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    return fla_chunk(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]


KERNELS = {"torch": torch_kernel, "fla": fla_kernel}


def fla_missing(device: torch.device) -> str | None:
    """Why fla's kernel cannot run here, or None."""
    if importlib.util.find_spec("fla") is None:
        return "skipped: fla-core is not installed (benchmarks/gpu_wheels.sh fetches its wheel)"
    if device.type != "cuda":
        return "skipped: fla's kernels are Triton, CUDA only"
    return None


def make_inputs(seq: int, heads: int, dk: int, dv: int, device: torch.device, dtype: torch.dtype) -> list:
    torch.manual_seed(0)
    shape = (1, seq, heads)
    q, k = (l2norm(torch.randn(*shape, dk, device=device)).to(dtype) for _ in range(2))
    v = torch.randn(*shape, dv, device=device).to(dtype)
    g = F.logsigmoid(torch.randn(shape, device=device) + 4)  # decays near 1, as trained gates are
    beta = torch.rand(shape, device=device).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def timed(kernel, xs: list, grad_out: torch.Tensor, chunk_size: int, warmup: int, steps: int) -> tuple[dict, list]:
    """The kernel's row, and its output and input gradients of the last step."""
    last = []

    def step() -> None:
        for x in xs:
            x.grad = None
        out = kernel(*xs, chunk_size=chunk_size)
        out.backward(grad_out)
        last[:] = [out.detach()]

    row = timed_steps(step, grad_out.shape[1], grad_out.is_cuda, warmup, steps)
    return row, [*last, *(x.grad for x in xs)]


def rel_errors(ours: list, reference: list) -> dict:
    errs = {name: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
            for name, a, b in zip(["out", *(f"d{n}" for n in INPUTS)], ours, reference, strict=True)}
    return {**errs, "max": max(errs.values()), "tolerance": BF16_TOL, "equal": max(errs.values()) <= BF16_TOL}


def measure(seq: int, chunk_size: int, warmup: int, steps: int, smoke: bool, report) -> None:
    """Both kernels at `seq` tokens; `report(key, value)` after each, so a cut-short run keeps what it measured."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, dk, dv = SMOKE_SHAPE if smoke else SHAPE
    report("shape", {"seq": seq, "value_heads": heads, "dk": dk, "dv": dv, "dtype": str(dtype),
                     "torch_chunk_size": chunk_size})
    xs = make_inputs(seq, heads, dk, dv, device, dtype)
    grad_out = torch.randn(1, seq, heads, dv, device=device).to(dtype)
    results = {}
    for name, why in (("torch", None), ("fla", fla_missing(device))):
        if why:
            report(name, {"status": why})
            continue

        def run(name: str = name) -> dict:
            row, results[name] = timed(KERNELS[name], xs, grad_out, chunk_size, warmup, steps)
            return row
        report(name, guarded(run, device))
    if len(results) == 2:
        report("fla_vs_torch", rel_errors(results["fla"], results["torch"]))
