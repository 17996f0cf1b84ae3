"""One published MoE layer, forward + backward, in every implementation bench_gpu_moe.py compares, with the same
weights and the same tokens: Tessera's grouped experts (torch._grouped_mm), its per-expert loop (the same module,
`experts.grouped = False`), TorchTitan's `torchtitan.models.moe.MoE` (the release gpu_titan.VERSION), and both
grouped ones again with torchao's Float8 rowwise grouped GEMMs (`Float8TrainingOpConfig`: the experts' weights
wrapped so that torch._grouped_mm runs as dynamically quantized float8 GEMMs; H100/H200 and later).

Each variant: `warmup` untimed steps, then `steps` timed ones (each synchronized); tokens/s from the median step;
its peak memory above what was allocated before its first step (activations, gradients and their workspace)."""

import importlib.util
import statistics
import time

import torch

# name: (family, flavor) whose MoE layer is measured
LAYERS = {"qwen3_30b_a3b": ("qwen3_moe", "30B-A3B"), "deepseek_v3_16b": ("deepseek_v3", "16B")}
SMOKE_LAYER = ("qwen3_moe", "debugmodel_moe")
VARIANTS = ("tessera_grouped", "loop", "torchtitan", "tessera_grouped_float8", "torchtitan_float8")


def layer_args(family: str, flavor: str):
    """(dim, MoEArgs) of the family's flavor: its own table's numbers."""
    from tessera.models import family as fam

    args = fam(family).flavors[flavor]
    return args.dim, args.moe


def titan_moe(dim: int, moe, tessera_layer: torch.nn.Module) -> torch.nn.Module:
    """TorchTitan's MoE with Tessera's routing settings and Tessera's weights (no load balancing buffer)."""
    from torchtitan.models.moe import MoE, MoEArgs

    grouped = moe.n_groups > 1
    args = MoEArgs(num_experts=moe.n_experts, num_shared_experts=moe.n_shared, score_func=moe.score_func,
                   route_norm=moe.route_norm, route_scale=moe.route_scale,
                   score_before_experts=moe.score_before_experts, top_k=moe.top_k,
                   num_expert_groups=moe.n_groups if grouped else None,
                   num_limited_groups=moe.top_groups if grouped else None, use_grouped_mm=True,
                   load_balance_coeff=None)
    ref = next(tessera_layer.parameters())
    layer = MoE(args, dim=dim, hidden_dim=moe.hidden).to(ref.device, ref.dtype)
    own = layer.state_dict()
    weights = {name.replace("shared.", "shared_experts."): t for name, t in tessera_layer.state_dict().items()}
    layer.load_state_dict({name: weights.get(name, t) for name, t in own.items()})
    return layer


def float8_ready(device: torch.device) -> str | None:
    """Why torchao's Float8 grouped GEMMs cannot run here, or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "skipped: Float8 grouped GEMMs need a CUDA GPU of compute capability 8.9 or later"
    if importlib.util.find_spec("torchao") is None:
        return "skipped: torchao is not installed"
    return None


def to_float8(layer: torch.nn.Module) -> None:
    """torchao's Float8 rowwise grouped GEMMs for the layer's routed experts (token groups padded to 16 rows; in
    TorchTitan's layer by its own padding, to 16 as its Float8 converter sets it)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    if type(layer).__module__.startswith("torchtitan."):
        from torchtitan.models.moe.utils import set_token_group_alignment_size_m
        set_token_group_alignment_size_m(16)

    quantize_(layer, Float8TrainingOpConfig(pad_token_groups_for_grouped_mm=True),
              filter_fn=lambda module, fqn: module is layer.experts)


def timed_steps(step, tokens: int, cuda: bool, warmup: int, steps: int) -> dict:
    """`step()` `warmup` times untimed, then `steps` times timed (each synchronized): tokens/s from the median step,
    the peak memory above what was allocated before the first (gpu_deltanet.py's kernels too)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    seconds = []
    for _ in range(warmup + steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[warmup:])
    return {"status": "ok", "tokens_per_s": tokens / median, "step_ms": median * 1e3, "first_step_s": seconds[0],
            "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None}


def timed(layer: torch.nn.Module, x: torch.Tensor, warmup: int, steps: int) -> dict:
    """Forward + backward of `layer` on `x` (a loss of the output's mean square)."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    return timed_steps(lambda: layer(x).float().square().mean().backward(), x.shape[0] * x.shape[1], x.is_cuda,
                       warmup, steps)


def guarded(run, device: torch.device) -> dict:
    """`run()`'s row; out of memory: `OOM`; any other error: a row saying why, not a stop (gpu_deltanet.py too)."""
    try:
        row = run()
    except torch.OutOfMemoryError:
        row = {"status": "OOM"}
    except Exception as e:  # noqa: BLE001 - a variant that does not run is a row saying why, not a stop
        row = {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def measure(family: str, flavor: str, tokens: int, warmup: int, steps: int, report) -> None:
    """Every variant of the layer on `tokens` tokens (bf16 on CUDA, fp32 on CPU); `report(variant, row)` after
    each, so a cut-short run keeps what it measured."""
    from tessera.models.common.moe import MoE

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dim, moe = layer_args(family, flavor)
    report("layer", {"family": family, "flavor": flavor, "dim": dim, "experts": moe.n_experts, "top_k": moe.top_k,
                     "hidden": moe.hidden, "shared": moe.n_shared, "tokens": tokens, "dtype": str(dtype)})
    torch.manual_seed(0)
    tessera = MoE(dim, moe, grouped=True).to(device, dtype)
    for p in tessera.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tessera.reset_buffers()
    x = torch.randn(2, tokens // 2, dim, device=device, dtype=dtype, requires_grad=True)
    titan, titan_why = None, None
    if importlib.util.find_spec("torchtitan") is None:
        titan_why = "skipped: torchtitan is not installed (benchmarks/gpu_wheels.sh fetches its wheel)"
    elif device.type != "cuda":  # checked with 0.2.2 on torch 2.11's CPU build
        titan_why = "skipped: TorchTitan's MoE runs on CUDA only (torch.histc of expert ids, Triton index kernels)"
    f8_why = float8_ready(device)

    def run(variant: str, layer, why: str | None = None, prepare=None) -> None:
        if why:
            return report(variant, {"status": why})

        def go() -> dict:
            if prepare:
                prepare()
            return timed(layer, x, warmup, steps)
        report(variant, guarded(go, device))

    run("tessera_grouped", tessera)

    def loop(on: bool) -> None:
        tessera.experts.grouped = not on
    run("loop", tessera, prepare=lambda: loop(True))
    loop(False)
    if titan_why is None:
        try:
            titan = titan_moe(dim, moe, tessera)
            with torch.no_grad():
                a, b = tessera(x), titan(x)
            report("torchtitan_vs_tessera", {"output_rel_err": ((a.float() - b.float()).abs().max()
                                                                / a.float().abs().max()).item()})
        except Exception as e:  # noqa: BLE001
            titan_why = f"failed: {type(e).__name__}: {str(e)[:300]}"
    run("torchtitan", titan, titan_why)
    run("tessera_grouped_float8", tessera, f8_why, prepare=lambda: to_float8(tessera))
    run("torchtitan_float8", titan, f8_why or titan_why, prepare=lambda: to_float8(titan))
