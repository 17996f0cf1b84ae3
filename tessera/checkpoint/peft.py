"""LoRA's adapters out as a PEFT folder (adapter_config.json, adapter_model.safetensors) that `peft` loads onto the
transformers model, or merged into the base weights of a Hugging Face export (lora.merge_on_export)."""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from tessera import models
from tessera.config import ConfigError
from tessera.config.sections import Lora
from tessera.lora import ADAPTERS, is_adapter
from tessera.parallel.tp import local

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def base_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if not is_adapter(k)}


def merged_state(state: dict, cfg: Lora) -> dict:
    """The base weights with each adapter's update folded in, W + (alpha / rank) B A (full tensors)."""
    out = base_state(state)
    for name in [k for k in state if k.endswith(".lora_a")]:
        linear = name.removesuffix(".lora_a")
        a, b = local(state[name]).float(), local(state[f"{linear}.lora_b"]).float()
        w = local(out[f"{linear}.weight"])
        out[f"{linear}.weight"] = (w.float() + cfg.alpha / cfg.rank * b @ a).to(w.dtype)
    return out


def _hf_module(hf, linear: str, weight: torch.Tensor) -> str:
    """The Hugging Face module of our linear, where the adapter renames it and nothing else (an adapter that splits,
    fuses or permutes the weight would need the same done to B or A)."""
    probe = torch.arange(weight.numel(), dtype=torch.float32).reshape(weight.shape)
    out = hf.to_hf({f"{linear}.weight": probe})
    (name, value), = out.items() if len(out) == 1 else ((None, None),)
    if name is None or not name.endswith(".weight") or not torch.equal(value, probe):
        raise ConfigError(f"lora: {linear}'s weight is not stored as it is in the Hugging Face layout, so its "
                          f"adapter has no PEFT name; export with lora.merge_on_export = true")
    return name.removesuffix(".weight")


def _peft_names(hf, state: dict):
    """(Hugging Face module, our adapter's name, its PEFT name) of each adapter in `state`."""
    for name in sorted(k for k in state if k.endswith(".lora_a")):
        linear = name.removesuffix(".lora_a")
        module = _hf_module(hf, linear, state[f"{linear}.weight"])
        for ours, theirs in zip(ADAPTERS, ("lora_A", "lora_B"), strict=True):
            yield module, f"{linear}.{ours}", f"base_model.model.{module}.{theirs}.weight"


def save_peft(state: dict, cfg: Lora, family: str, out_dir: str | Path, dtype: torch.dtype | None,
              base_model: str | None) -> None:
    """Every rank calls it (full tensors are gathered); rank 0 writes. `base_model`: adapter_config.json's
    base_model_name_or_path."""
    from safetensors.torch import save_file

    tensors, modules = {}, []
    for module, ours, theirs in _peft_names(models.family(family).hf, state):
        modules.append(module)
        t = local(state[ours]).detach()
        tensors[theirs] = t.to(dtype or t.dtype).contiguous().cpu()
    if dist.is_initialized():  # pipeline stages hold different adapters
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (tensors, modules))
        tensors = {k: v for part, _ in gathered for k, v in part.items()}
        modules = [m for _, part in gathered for m in part]
        if dist.get_rank() != 0:
            return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.rank,
              "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": sorted(set(modules)),
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "init_lora_weights": True}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def load_peft(model: torch.nn.Module, folder: str, family: str) -> None:
    """The adapters of a PEFT folder into the model's (of any layout: full tensors, each rank keeping its part)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from tessera.checkpoint.plain import model_state

    stored, have, state = load_file(str(Path(folder) / WEIGHTS)), model_state(model), {}
    for module, ours, key in _peft_names(models.family(family).hf, have):
        if key not in stored:
            raise ConfigError(f"lora.initial_adapter_path: '{folder}' holds no adapter of {module} ({key}); "
                              f"set lora.target_modules to the folder's")
        if tuple(stored[key].shape) != tuple(have[ours].shape):
            raise ConfigError(f"lora.initial_adapter_path: {key} in '{folder}' is {list(stored[key].shape)}, "
                              f"this run's {list(have[ours].shape)}")
        state[ours] = stored[key]
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
