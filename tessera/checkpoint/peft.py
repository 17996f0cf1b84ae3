"""LoRA's adapters out as a PEFT folder (adapter_config.json, adapter_model.safetensors) that `peft` loads onto the
transformers model, or merged into the base weights of a Hugging Face export (lora.merge_on_export)."""

import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist

from tessera import models
from tessera.config import ConfigError
from tessera.config.sections import Lora
from tessera.lora import ADAPTERS, adaptable, adapted_weight, is_adapter, names_end, targets
from tessera.parallel.tp import local

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
log = logging.getLogger("tessera")


def base_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if not is_adapter(k)}


def merged_state(state: dict, cfg: Lora) -> dict:
    """The base weights with each adapter's update folded in, W + (alpha / rank) B A (full tensors)."""
    out = base_state(state)
    for name in [k for k in state if is_adapter(k) and k.endswith("lora_a")]:
        a, b = local(state[name]).float(), local(state[name.removesuffix("a") + "b"]).float()
        weight = adapted_weight(name)
        w = local(out[weight])
        out[weight] = (w.float() + cfg.alpha / cfg.rank * b @ a).to(w.dtype)  # per expert for [E, ...] stacks
    return out


def _hf_module(hf, linear: str, state: dict) -> str:
    """The Hugging Face module of our linear, where the adapter renames it and nothing else (an adapter that splits,
    fuses or permutes the weight would need the same done to B or A). The adapter sees the linear among the other
    weights of its block, as an adapter may need them to tell what the linear is (Qwen 3.5's DeltaNet q/k/v, fused
    in its Hugging Face layout, from full attention's): all on the meta device; renamed, the weight is the tensor
    given."""
    block = re.match(r".*?\blayers\.\d+\.", linear)
    prefix = block[0] if block else f"{linear}."
    context = {k: torch.empty(tuple(v.shape), device="meta") for k, v in state.items()
               if k.startswith(prefix) and not is_adapter(k) and ".experts." not in k}
    probe = context[f"{linear}.weight"] = torch.empty(tuple(state[f"{linear}.weight"].shape), device="meta")
    try:
        names = [n for n, v in hf.to_hf(context).items() if v is probe]
    except (RuntimeError, KeyError, ValueError, NotImplementedError):
        names = []
    name = names[0] if len(names) == 1 else None
    if name is None or not name.endswith(".weight"):
        raise ConfigError(f"lora: {linear}'s weight is not stored as it is in the Hugging Face layout, so its "
                          f"adapter has no PEFT name; export with lora.merge_on_export = true")
    return name.removesuffix(".weight")


def own_targets(model: torch.nn.Module, names: list[str], family: str) -> tuple[list[str], dict[str, list[str]]]:
    """lora.target_modules in this model's own names. A name that ends none of its linears and expert stacks but ends
    the Hugging Face names of some of its linears (q_proj, v_proj: transformers' modules, what PEFT users write)
    stands for those linears, named by the shortest ends of ours that pick them and no others. Returns the names and
    {each name taken from Hugging Face: the ends of ours it became}; a name neither knows is kept (check_targets
    refuses it)."""
    ours = [fqn for fqn, *_ in adaptable(model)]
    unknown = [n for n in names if not any(names_end(f, n) for f in ours)]
    hf = models.family(family).hf
    if not unknown or hf is None:
        return names, {}
    state, theirs = model.state_dict(), {}
    for fqn in (fqn for fqn, _, stack, _ in adaptable(model) if stack is None):
        try:
            theirs[fqn] = _hf_module(hf, fqn, state)
        except ConfigError:  # stored fused or otherwise changed: no module of transformers' is this linear alone
            pass
    out, mapped = [], {}
    for name in names:
        picked = {fqn for fqn, module in theirs.items() if names_end(module, name)} if name in unknown else set()
        if picked:
            mapped[name] = list(dict.fromkeys(_shortest_end(fqn, ours, picked) for fqn in sorted(picked)))
        out += [n for n in mapped.get(name, [name]) if n not in out]
    return out, mapped


def _shortest_end(fqn: str, ours: list[str], picked: set[str]) -> str:
    """The shortest end of `fqn` (whole name parts, not starting at a block's number) that ends no name of `ours`
    outside `picked`."""
    parts = fqn.split(".")
    ends = (".".join(parts[-k:]) for k in range(1, len(parts) + 1) if not parts[-k].isdigit())
    return next(e for e in ends if all(f in picked for f in ours if names_end(f, e)))


def _peft_names(hf, state: dict):
    """(Hugging Face module, our adapter's name, its PEFT name) of each linear's adapter in `state`."""
    for name in sorted(k for k in state if k.endswith(".lora_a")):
        linear = name.removesuffix(".lora_a")
        module = _hf_module(hf, linear, state)
        for ours, theirs in zip(ADAPTERS, ("lora_A", "lora_B"), strict=True):
            yield module, f"{linear}.{ours}", f"base_model.model.{module}.{theirs}.weight"


def check_exportable(model: torch.nn.Module, cfg, family: str) -> None:
    """Before any weight exists: a run whose final export is a PEFT folder (checkpoint.last_save_in_hf without
    lora.merge_on_export) with adapters that peft cannot hold for this family (on a weight its Hugging Face layout
    fuses with others, on expert stacks it keeps elsewhere) is refused."""
    if not (cfg.lora.rank and cfg.checkpoint.last_save_in_hf) or cfg.lora.merge_on_export:
        return
    found = targets(model, cfg.lora.target_modules)
    hf, weights = models.family(family).hf, model.state_dict()
    state = {f"{fqn}_lora_a": None for fqn, _, stack, _ in found if stack}
    try:
        for fqn in (fqn for fqn, _, stack, _ in found if not stack):
            _hf_module(hf, fqn, weights)
        _expert_params(hf, state)
    except ConfigError as e:
        raise ConfigError(f"{e} (the final save, checkpoint.last_save_in_hf, is a PEFT folder)") from None


def _expert_params(hf, state: dict) -> dict[str, list[tuple[int, int, str]]]:
    """{transformers' parameter: [(block, blocks, our stack)]} of the expert stacks `state` has adapters of, in the
    order of the parameters in their modules. peft adapts a 3-D parameter [E, out, in] with one rank-R factor pair
    per expert (target_parameters); our stacks that share a fused parameter (gate and up) are its blocks of output
    rows, their adapters one pair of rank R = blocks x rank whose B is block-diagonal."""
    params, position = {}, {}
    for name in sorted(k for k in state if k.endswith("_lora_a")):
        stack = adapted_weight(name)
        where = getattr(hf, "peft_param", lambda _: None)(stack)
        if where is None:
            raise ConfigError(f"lora: {stack} has adapters, which PEFT cannot hold for this model; export with "
                              f"lora.merge_on_export = true")
        param, position[param], *block = where
        params.setdefault(param, []).append((*block, stack))
    order = sorted(params, key=lambda p: (p.rsplit(".", 1)[0], position[p]))
    return {p: sorted(params[p]) for p in order}


def _nested_keys(params: list[str]) -> dict[str, str]:
    """PEFT's key prefix of each targeted parameter (in their modules' order): a module with several wraps them in
    turn, the first innermost (`experts.base_layer.lora_A` beside `experts.lora_A`)."""
    by_module = {}
    for p in params:
        by_module.setdefault(p.rsplit(".", 1)[0], []).append(p)
    return {p: f"base_model.model.{module}." + "base_layer." * (len(ps) - 1 - i)
            for module, ps in by_module.items() for i, p in enumerate(ps)}


def _fused_pair(state: dict, entries: list[tuple[int, int, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's lora_A [E R, in] (expert-major rows) and lora_B [out, R E] (rank-major columns) of one parameter."""
    a = torch.cat([local(state[f"{stack}_lora_a"]).detach() for *_, stack in entries], dim=1)
    experts, rank, blocks = a.shape[0], a.shape[1] // len(entries), entries[0][1]
    rows = local(state[f"{entries[0][2]}_lora_b"]).shape[1]
    b = a.new_zeros(experts, rows * blocks, rank * len(entries))
    for i, (block, _, stack) in enumerate(entries):
        b[:, block * rows:(block + 1) * rows, i * rank:(i + 1) * rank] = local(state[f"{stack}_lora_b"]).detach()
    return a.reshape(-1, a.shape[-1]), b.permute(1, 2, 0).reshape(b.shape[1], -1)


def save_peft(state: dict, cfg: Lora, family: str, out_dir: str | Path, dtype: torch.dtype | None,
              base_model: str | None) -> None:
    """Every rank calls it (full tensors are gathered); rank 0 writes. `base_model`: adapter_config.json's
    base_model_name_or_path."""
    from safetensors.torch import save_file

    hf, tensors, modules, ranks = models.family(family).hf, {}, [], {}
    for module, ours, theirs in _peft_names(hf, state):
        modules.append(module)
        tensors[theirs] = local(state[ours]).detach()
    experts = _expert_params(hf, state)
    for param, prefix in _nested_keys(list(experts)).items():
        tensors[f"{prefix}lora_A.weight"], tensors[f"{prefix}lora_B.weight"] = _fused_pair(state, experts[param])
        ranks[param] = cfg.rank * len(experts[param])
    tensors = {k: t.to(dtype or t.dtype).contiguous().cpu() for k, t in tensors.items()}
    if dist.is_initialized():  # pipeline stages hold different adapters
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (tensors, modules, ranks))
        tensors = {k: v for part, _, _ in gathered for k, v in part.items()}
        modules = [m for _, part, _ in gathered for m in part]
        ranks = {p: r for _, _, part in gathered for p, r in part.items()}
        if dist.get_rank() != 0:
            return
    dropout = cfg.dropout
    if ranks and dropout:
        log.warning(f"lora: the PEFT export says lora_dropout = 0 (PEFT's adapters on expert parameters take no "
                    f"dropout); this run trained with {dropout}, which inference never applies")
        dropout = 0.0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    fused = {p: r for p, r in ranks.items() if r != cfg.rank}  # peft 0.21 applies them, and warns it did not
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.rank,
              "lora_alpha": cfg.alpha, "lora_dropout": dropout, "target_modules": sorted(set(modules)),
              "target_parameters": sorted(ranks) or None, "rank_pattern": fused,
              "alpha_pattern": {p: cfg.alpha * r / cfg.rank for p, r in fused.items()},
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "init_lora_weights": True}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def load_peft(model: torch.nn.Module, folder: str, family: str) -> None:
    """The adapters of a PEFT folder into the model's (of any layout: full tensors, each rank keeping its part)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from tessera.checkpoint.plain import model_state

    hf = models.family(family).hf
    stored, have, state = load_file(str(Path(folder) / WEIGHTS)), model_state(model), {}

    def read(key: str, what: str, shape) -> torch.Tensor:
        if key not in stored:
            raise ConfigError(f"lora.initial_adapter_path: '{folder}' holds no adapter of {what} ({key}); "
                              f"set lora.target_modules to the folder's")
        if tuple(stored[key].shape) != tuple(shape):
            raise ConfigError(f"lora.initial_adapter_path: {key} in '{folder}' is {list(stored[key].shape)}, "
                              f"this run's {list(shape)}")
        return stored[key]

    for module, ours, key in _peft_names(hf, have):
        state[ours] = read(key, module, have[ours].shape)
    experts = _expert_params(hf, have)
    for param, prefix in _nested_keys(list(experts)).items():
        entries, first = experts[param], experts[param][0][2]
        (n_experts, rank, inputs), rows = have[f"{first}_lora_a"].shape, have[f"{first}_lora_b"].shape[1]
        fused = rank * len(entries)
        a = read(f"{prefix}lora_A.weight", param, (n_experts * fused, inputs)).reshape(n_experts, fused, inputs)
        b = read(f"{prefix}lora_B.weight", param, (rows * entries[0][1], fused * n_experts))
        b = b.reshape(b.shape[0], fused, n_experts).permute(2, 0, 1).clone()  # [E, out, R]
        for i, (block, _, stack) in enumerate(entries):
            cols = slice(i * rank, (i + 1) * rank)
            state[f"{stack}_lora_a"] = a[:, cols]
            state[f"{stack}_lora_b"] = b[:, block * rows:(block + 1) * rows, cols].clone()
            b[:, block * rows:(block + 1) * rows, cols] = 0
        if b.any():
            raise ConfigError(f"lora.initial_adapter_path: {param}'s adapter in '{folder}' mixes the blocks of its "
                              f"fused rows ({', '.join(s for *_, s in entries)}), which Tessera adapts apart")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
