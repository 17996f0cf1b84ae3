"""LoRA: a trainable low-rank update beside chosen linears of a frozen model ([lora]).

A target linear y = W x gets two parameters of its own, lora_a (rank x in) and lora_b (out x rank), and a forward
hook adding (alpha / rank) * B A dropout(x) to its output. Registered on the linear itself, they are parameters
like its weight: FSDP shards them with the block, a pipeline stage holds them with its layers, TP places them
after its plan (tessera.parallel.tp.place_adapters), compile traces the hook, and a Float8 base linear (converted
first) adds a high-precision adapter. B starts at zero, so a run starts from the base model's outputs.

Stacked experts [E, out, in] (tessera.models.common.moe.Experts: `w1`, `w2`, `w3`) get one adapter per expert,
`{stack}_lora_a` [E, rank, in] and `{stack}_lora_b` [E, out, rank], which the experts' forward adds; stacked, EP
splits them over experts and FSDP shards them as it does the stacks.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError
from tessera.config.sections import Lora
from tessera.parallel.init import bare_name

ADAPTERS = ("lora_a", "lora_b")


def is_adapter(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last in ADAPTERS or last.endswith(("_lora_a", "_lora_b"))  # a linear's, or an expert stack's


def adapted_weight(lora_a: str) -> str:
    """The weight an `...lora_a` adapter adapts: a linear's `X.weight` for `X.lora_a`, the stack `S` for `S_lora_a`."""
    return lora_a.removesuffix(".lora_a") + ".weight" if lora_a.endswith(".lora_a") else lora_a.removesuffix("_lora_a")


def names_end(fqn: str, name: str) -> bool:
    return fqn == name or fqn.endswith("." + name)  # whole name parts: `wo` is not `w`


def adaptable(model: nn.Module):
    """(bare name, module, stack or None, (out, in)) of every linear and stacked expert weight."""
    for fqn, m in model.named_modules():
        name = bare_name(fqn + ".").rstrip(".")
        if isinstance(m, nn.Linear):
            yield name, m, None, (m.out_features, m.in_features)
        for stack in getattr(m, "ADAPTABLE", ()):
            yield f"{name}.{stack}", m, stack, tuple(getattr(m, stack).shape[1:])


def targets(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module, str | None, tuple[int, int]]]:
    """The linears and expert stacks whose bare names end with one of `names`."""
    return [t for t in adaptable(model) if any(names_end(t[0], n) for n in names)]


def check_targets(model: nn.Module, cfg: Lora) -> None:
    """On the whole model (a pipeline stage lacks some linears): ConfigError for targets that match no linear or
    expert stack, and a rank above a target's size."""
    if cfg.rank == 0:
        return
    found = targets(model, cfg.target_modules)
    if missing := [n for n in cfg.target_modules if not any(names_end(f, n) for f, *_ in found)]:
        raise ConfigError(f"lora.target_modules: {', '.join(missing)} match(es) no linear of this model, by its names "
                          f"or Hugging Face's; name the ends of linear names, e.g. {', '.join(_examples(model))}")
    for fqn, _, _, (out, inp) in found:
        if cfg.rank > min(inp, out):
            raise ConfigError(f"lora.rank: {cfg.rank} is above {fqn}'s size ({out} x {inp}); a rank of at most "
                              f"{min(inp, out)} adapts it, or leave {fqn.rsplit('.', 1)[-1]} out of "
                              f"lora.target_modules")


def apply_lora(model: nn.Module, cfg: Lora) -> list[str]:
    """Adapters on the target linears and expert stacks of `model` (on the meta device, before TP and FSDP);
    returns their names."""
    if cfg.rank == 0:
        return []
    found = targets(model, cfg.target_modules)
    for _, module, stack, (out, inp) in found:
        if stack is not None:
            module.adapt(stack, cfg.rank, cfg.alpha / cfg.rank, cfg.dropout)
            continue
        w = module.weight
        module.register_parameter("lora_a", nn.Parameter(w.new_empty(cfg.rank, inp)))
        module.register_parameter("lora_b", nn.Parameter(w.new_empty(out, cfg.rank)))
        module.register_forward_hook(functools.partial(_add_update, scale=cfg.alpha / cfg.rank, dropout=cfg.dropout))
    return [fqn for fqn, *_ in found]


def _examples(model: nn.Module) -> list[str]:
    return list(dict.fromkeys(fqn.rsplit(".", 1)[-1] for fqn, *_ in adaptable(model)))[:8]


def _add_update(linear: nn.Module, args: tuple, out: torch.Tensor, *, scale: float, dropout: float) -> torch.Tensor:
    x = F.dropout(args[0], dropout, linear.training) if dropout else args[0]
    return out + scale * F.linear(F.linear(x, linear.lora_a), linear.lora_b)


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train (after parallelization, which makes new parameters of what it shards)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def initializer(cfg: Lora, base: Callable) -> Callable:
    """tessera.parallel.init.materialize's `init`: adapters as [lora] init says, every other parameter by `base`
    (the model's param_init)."""
    def init(name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        if not is_adapter(name):
            base(name, full, gen)
        elif name.endswith("lora_b"):
            full.zero_()
        elif cfg.init == "gaussian":
            full.normal_(0.0, 1.0 / cfg.rank, generator=gen)
        else:  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT: bound 1 / sqrt(in)
            bound = 1.0 / math.sqrt(full.shape[-1])
            full.uniform_(-bound, bound, generator=gen)
    return init


def trained_counts(counts, cfg: Lora):
    """The model's counts (tessera.models.contract.Counts) as a LoRA run computes: backward skips the frozen
    weights' gradients, 2 of the 6 FLOPs a weight costs a token (the adapters' own are a rounding)."""
    if not cfg.rank:
        return counts
    return dataclasses.replace(counts, flops_per_token=counts.flops_per_token - 2 * (counts.active - counts.embedding))
