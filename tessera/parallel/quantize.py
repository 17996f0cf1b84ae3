"""Low-precision matmuls for training (torchao): Float8 and MXFP8 linears, as `model.converters`.

Converters run on the meta model before TP/FSDP. Master weights, optimizer state and checkpoints stay in
high precision: only the matmuls (and, optionally, FSDP's all-gathers) run in 8 bits, so parameter
names and checkpoint keys do not change. The names configs accept are in tessera/config/sections.py.
"""

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from tessera.config import ConfigError, JobConfig
from tessera.config.sections import FLOAT8_CONVERTER as FLOAT8, MX_CONVERTER as MX, MX_RECIPES

log = logging.getLogger("tessera")

AUTO_FILTER = "auto_filter_small_kn"
# Our recipe name -> torchao MXFP8TrainingRecipe value. mxfp8_cublas (the name older torchao used for
# its cuBLAS MXFP8 recipe) is today's RCEIL recipe with the best available kernels.
_TORCHAO_MX = {name: "mxfp8_rceil" if name == "mxfp8_cublas" else name for name in MX_RECIPES}
# Minimum CUDA compute capability with hardware support: float8 from Ada/Hopper, MX from Blackwell.
_MIN_CAPABILITY = {FLOAT8: (8, 9), MX: (10, 0)}


def check_hardware(converter: str, emulate: bool, device: torch.device) -> None:
    """Refuse, before any weight exists, a converter this device cannot run natively unless emulated."""
    if emulate:
        return
    need = _MIN_CAPABILITY[converter]
    have = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if have is None or have < need:
        where = f"compute capability {have[0]}.{have[1]}" if have else f"a {device.type} device"
        raise ConfigError(f"{converter}: needs a CUDA GPU with compute capability >= {need[0]}.{need[1]}, but this "
                          f"run has {where}; set {converter}.emulate = true to emulate it (slow; for tests) or "
                          f"remove it from model.converters")


def _linear_filter(filter_fqns: list[str], auto: Callable | None = None) -> Callable[[nn.Module, str], bool]:
    """True for the linears to convert: not named by `filter_fqns`, and big enough per `auto` if given."""
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in filter_fqns):
            return False
        return auto is None or auto(module, fqn)
    return keep


def _log_converted(what: str, names: list[str]) -> None:
    log.info(f"{what}: converted {len(names)} linear layer(s)")
    log.debug(f"{what}: converted {', '.join(names)}")


def apply_float8(model: nn.Module, cfg, device: torch.device, high_precision: tuple[str, ...] = ()) -> list[str]:
    """Swap nn.Linear for torchao's Float8Linear (dynamic scaling, per the recipe), except those named by
    `high_precision` (the family's) or cfg.filter_fqns; returns converted names."""
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    check_hardware(FLOAT8, cfg.emulate, device)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe_name),
                                 enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather, emulate=cfg.emulate)
    fqns = [*high_precision, *(f for f in cfg.filter_fqns if f != AUTO_FILTER)]
    # torchao's rule: skip dims not divisible by 16 and GEMMs whose (K, N) are too small to gain on H100.
    auto = _auto_filter_for_recipe(cfg.recipe_name, filter_fqns=fqns) if AUTO_FILTER in cfg.filter_fqns else None
    convert_to_float8_training(model, config=config, module_filter_fn=_linear_filter(fqns, auto))
    names = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    _log_converted(f"float8 {cfg.recipe_name}", names)
    return names


def apply_mx(model: nn.Module, cfg, device: torch.device, high_precision: tuple[str, ...] = ()) -> list[str]:
    """MXFP8 (32-element blocks, e8m0 scales): wrap each converted linear's weight in torchao's MXFP8 tensor
    (not those named by `high_precision` or cfg.filter_fqns)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    check_hardware(MX, cfg.emulate, device)
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(_TORCHAO_MX[cfg.recipe_name]))
    if cfg.emulate:  # the same quantization, with plain matmuls on dequantized blocks
        config = dataclasses.replace(config, kernel_preference=KernelPreference.EMULATED)
    fqns = [*high_precision, *(f for f in cfg.filter_fqns if f != AUTO_FILTER)]
    # MX scales blocks of 32 along K, and the kernels need N and K multiples of 32 too.

    def auto(m: nn.Module, _: str) -> bool:
        return m.in_features % 32 == 0 and m.out_features % 32 == 0
    quantize_(model, config, filter_fn=_linear_filter(fqns, auto))
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and isinstance(m.weight.data, MXFP8TrainingWeightWrapperTensor)]
    _log_converted(f"mx {cfg.recipe_name}", names)
    return names


def apply_converters(model: nn.Module, cfg: JobConfig, device: torch.device,
                     high_precision: tuple[str, ...] = ()) -> None:
    for name in cfg.model.converters:
        if name == FLOAT8:
            apply_float8(model, cfg.quantize.linear.float8, device, high_precision)
        elif name == MX:
            apply_mx(model, cfg.quantize.linear.mx, device, high_precision)
        else:
            raise ConfigError(f"model.converters: unknown converter '{name}'; choose from {FLOAT8}, {MX}")


def post_optimizer_hook(model: nn.Module, cfg: JobConfig) -> Callable[[], None] | None:
    """Float8 all-gather with tensorwise scales: one fused amax all-reduce per step instead of one per weight."""
    f8 = cfg.quantize.linear.float8
    if FLOAT8 not in cfg.model.converters or not f8.precompute_float8_dynamic_scale_for_fsdp:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
