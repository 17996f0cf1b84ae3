"""Model families. Each lives in one folder whose `__init__.py` defines `FAMILY` (a
tessera.models.contract.Family): `tessera/models/<name>/`, or, for a family of a group, a folder in the group's
folder (`tessera/models/qwen3_5/moe/`), beside the code the group's families share. Groups never import each other;
the building blocks several groups share are in `tessera/models/common/`."""

import dataclasses
import importlib
import json
import os
from typing import NamedTuple

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4", "flux", "qwen3_5", "qwen3_5_moe",
            "qwen3_next", "kimi_linear", "deepseek_v4")
# The folder (under tessera/models/) of each family in a group; any other family's is named as the family.
IN_GROUPS = {"qwen3": "qwen3.dense", "qwen3_moe": "qwen3.moe", "deepseek_v3": "deepseek.v3",
             "qwen3_5": "qwen3_5.dense", "qwen3_5_moe": "qwen3_5.moe", "qwen3_next": "qwen3_5.next",
             "kimi_linear": "deepseek.kimi_linear", "deepseek_v4": "deepseek.v4"}


def family(name: str):
    """The family called `name` (torch-free; `.spec()` imports its torch side)."""
    if name not in FAMILIES:
        raise KeyError(f"unknown model family '{name}'; one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"tessera.models.{IN_GROUPS.get(name, name)}").FAMILY


def family_of(args):
    """The family whose flavors are of `args`'s type."""
    for name in FAMILIES:
        fam = family(name)
        if type(args) is type(next(iter(fam.flavors.values()))):
            return fam
    raise KeyError(f"no model family has args of type {type(args).__name__}")


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def arch_differences(saved, asked, labels: tuple[str, str] = ("checkpoint", "asked")) -> list[str]:
    """The fields of `args.arch()` (what the model computes with; not max_seq_len, the RoPE table's length set
    from training.seq_len) in which two args differ, as 'field: saved (checkpoint) vs asked (asked)'. A field
    one side lacks is moot there (the scaling details of an unscaled RoPE, whose factor already differs)."""
    theirs, ours = saved.arch(), asked.arch()
    return [f"{k}: {theirs[k]!r} ({labels[0]}) vs {ours[k]!r} ({labels[1]})"
            for k in theirs if k in ours and theirs[k] != ours[k]]


def args_to_json(name: str, args) -> dict:
    """What a checkpoint records of its model: `model.json` = {"family": name, "args": {...}}."""
    return {"family": name, "args": dataclasses.asdict(args)}


def args_from_json(record: dict) -> tuple[str, object]:
    """(family, args) from a `model.json` record; unknown fields raise TypeError, a missing family KeyError."""
    name = record["family"]
    cls = type(next(iter(family(name).flavors.values())))
    return name, cls(**record["args"])


def family_of_hf_config(config: dict, where: str):
    """The family of a Hugging Face config.json (read from `where`): transformers' model_type (a multimodal
    release's in its text_config, as Llama 4's) or diffusers' _class_name (Flux's transformer/ folder)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    names = {config.get("model_type"), text.get("model_type"), config.get("_class_name")} - {None}
    for name in FAMILIES:
        if {family(name).hf_model_type, *family(name).hf_also_reads} & names:
            return family(name)
    known = ", ".join(family(n).hf_model_type for n in FAMILIES)
    said = " or ".join(f"{k} {config[k]!r}" for k in ("model_type", "_class_name") if k in config) or "no model_type"
    raise ValueError(f"{where}: {said} is none of Tessera's families' ({known}); a transformers config names "
                     f"model_type, a diffusers one _class_name")


class HFFit(NamedTuple):
    """What a Hugging Face folder holds: the architecture to build, the parts of it (parameter name prefixes)
    that the folder lacks and that stay as initialized, and a line saying how it differs from config.json."""
    args: object
    fresh: tuple[str, ...] = ()
    note: str | None = None


def hf_fit(name: str, path: str, train: bool = False) -> HFFit:
    """The architecture the config.json of the Hugging Face folder at `path` (or beside the file `path`)
    describes, fitted to the weights beside it by the family's adapter (`fit_to_weights`: DeepSeek's MTP depths
    that transformers declares but never saves are left out, or, for a run that trains them (`train`), start
    freshly initialized); ValueError naming the file when it is missing, unreadable, or not one the family
    computes."""
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    config = os.path.join(folder, "config.json")
    adapter = family(name).hf
    try:
        with open(config) as fh:
            args = adapter.args_from_hf_config(json.load(fh))
    except FileNotFoundError:
        raise ValueError(f"no config.json in '{folder}': the weights' architecture is unknown; a Hugging Face "
                         f"folder holds one beside its safetensors") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{config}: {e}") from None
    if not hasattr(adapter, "fit_to_weights"):
        return HFFit(args)
    from tessera.models.common.hf import stored_names

    return HFFit(*adapter.fit_to_weights(args, stored_names(folder), train))


def hf_args(name: str, path: str, train: bool = False):
    """hf_fit's architecture."""
    return hf_fit(name, path, train).args
