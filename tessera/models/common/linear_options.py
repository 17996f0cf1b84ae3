"""The options of a family with linear-attention layers (Qwen 3.5's Gated DeltaNet, Kimi Linear's KDA): how their
rule computes, applied to the model by its plan, and the checks of what context parallelism needs of them."""

import importlib.util
import logging
from dataclasses import dataclass

from tessera.config.sections import opt


@dataclass
class LinearAttentionOptions:
    chunk_size: int = opt(64, "tokens per chunk of the chunked linear-attention rule (Gated DeltaNet, KDA; torch "
                          "path): within a chunk the delta-rule updates are matmuls and one triangular solve, across "
                          "chunks a scan; larger chunks do more parallel work and fewer sequential steps (fla's "
                          "kernels fix their own)", min=1)
    kernel: str = opt("auto", "the linear-attention layers' kernel: auto (fla's on CUDA when flash-linear-attention "
                      "is installed, else the chunked torch one), torch, or fla (CUDA, needs the fla extra; not under "
                      "all-gather CP, whose state passing runs the torch one)",
                      choices=("auto", "torch", "fla"))


def apply_options(model, options: LinearAttentionOptions, device, rank0: bool, state_passing: bool = False) -> None:
    """Each linear-attention layer computes as the options say; one line says which kernel runs (`state_passing`:
    under all-gather CP the layers run the chunked torch form from each chunk's initial state, whatever the kernel)."""
    from tessera.models.common.deltanet import LinearMixer

    layers = [m for m in model.modules() if isinstance(m, LinearMixer)]
    for module in layers:
        module.chunk_size, module.kernel = options.chunk_size, options.kernel
    if layers and options.kernel == "fla" and not layers[0].uses_fla(device):
        raise ValueError(f"kernel = 'fla': fla's kernels run on CUDA with flash-linear-attention installed, not on "
                         f"{device.type}; use auto or torch")
    if layers and rank0:
        fla = layers[0].uses_fla(device) and not state_passing
        logging.getLogger("tessera").info(
            f"{layers[0].label} ({len(layers)} layers): "
            + ("fla's chunked kernels" if fla else f"the chunked torch path, {options.chunk_size} per chunk")
            + (" (all-gather CP: state passing)" if state_passing else ""))


def state_passing(world, cfg) -> bool:
    """Whether the linear-attention layers pass states between CP ranks (all-gather CP) rather than run whole
    sequences (Ulysses, no CP)."""
    return world.dims.cp > 1 and cfg.parallelism.context_parallel_method != "ulysses"


def check(cfg, dims, section: str, conv_kernel: int, key_heads: int, mixer: str) -> None:
    """The section's options; and context parallelism: Ulysses splits the linear layers' recurrence by whole key
    heads (`key_heads`); all-gather CP runs it by state passing (each rank its chunks,
    tessera.parallel.cp.StatePassing), unbounded by heads, the convolution (`conv_kernel` wide) reading the inputs
    before each chunk from the chunk before. `mixer`: the layers' name in the lines (DeltaNet, KDA)."""
    options = getattr(cfg, section)
    label, method = f"{cfg.model.name} {cfg.model.flavor or 'model'}", cfg.parallelism.context_parallel_method
    ranks = dims.tp * dims.cp
    piece = cfg.training.seq_len // (2 * dims.cp)
    if dims.cp > 1 and method != "ulysses" and piece < conv_kernel - 1:
        raise ValueError(f"parallelism.context_parallel_degree: all-gather CP {dims.cp} cuts each sequence into "
                         f"{2 * dims.cp} chunks of {piece} tokens, and {label}'s {mixer} convolution reads "
                         f"the {conv_kernel - 1} before each token from the chunk before; lengthen training.seq_len "
                         f"or lower the CP degree")
    if dims.cp > 1 and method == "ulysses" and key_heads % ranks:
        raise ValueError(f"parallelism.context_parallel_degree: ulysses splits {label}'s {key_heads} {mixer} key "
                         f"heads over TP {dims.tp} x CP {dims.cp} = {ranks} ranks, which do not divide them; use "
                         f"a CP degree dividing the {key_heads // dims.tp} key heads per TP rank, or "
                         f"context_parallel_method = \"allgather\" (the linear layers by state passing)")
    if options.kernel == "fla" and dims.cp > 1 and method != "ulysses":
        raise ValueError(f"{section}.kernel: fla's kernels do not run under all-gather CP {dims.cp}: its {mixer} "
                         f"layers pass states between the ranks' chunks in the chunked torch form; use kernel = "
                         f"\"auto\" or \"torch\", or context_parallel_method = \"ulysses\"")
    if options.kernel == "fla" and importlib.util.find_spec("fla") is None:
        raise ValueError(f"{section}.kernel: fla is not installed; pip install 'tessera[fla]' (CUDA), or use auto")
