"""Hugging Face safetensors in and out, for plain or sharded (DTensor) models, through DCP.

Generic: the family's `tessera.models.<family>.hf` module maps names (`to_hf`, `from_hf`) and writes
config.json (`hf_config`). Both directions run on every rank of a job (each rank reads or writes only
its own shards) or in one process without a process group.
"""

import importlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # as transformers' save_pretrained


class HFError(ValueError):
    """Bad Hugging Face input: the message is one line naming the path, tensor or shape at fault."""


def adapter(family: str):
    return importlib.import_module(f"tessera.models.{family}.hf")


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _file_index(state: dict, max_shard_bytes: int) -> dict[str, int]:
    """Tensor name -> output file number (1..n), filled in order up to `max_shard_bytes` per file."""
    index, file, used = {}, 1, 0
    for name, t in state.items():
        size = t.numel() * t.element_size()  # global size, also for DTensors
        if used and used + size > max_shard_bytes:
            file, used = file + 1, 0
        index[name], used = file, used + size
    return index


def save_hf(model_state: dict | nn.Module, args, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            family: str = "llama3", max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` + `config.json` to `out_dir`.

    `model_state`: our names -> tensors or DTensors (or the model itself, read with get_model_state_dict).
    Call it on every rank when any value is a DTensor: each rank writes its shards under out_dir/sharded,
    then rank 0 merges them into full tensors and removes the shards.
    """
    if isinstance(model_state, nn.Module):
        model_state = get_model_state_dict(model_state)
    hf = adapter(family)
    state = hf.to_hf(model_state)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    out = Path(out_dir)
    if _rank0():  # stale shards or files of an earlier export would be merged into or read with this one
        shutil.rmtree(out / "sharded", ignore_errors=True)
        for old in [*out.glob("model-*-of-*.safetensors"), out / INDEX]:
            old.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=_file_index(state, max_shard_bytes),
                                      save_distributed=True, enable_consolidation=True)
    with warnings.catch_warnings():  # "torch.distributed is disabled ..." in a single process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer)  # rank 0 has consolidated when this returns on any rank
    if _rank0():
        shutil.rmtree(out / "sharded", ignore_errors=True)
        config = hf.hf_config(args)
        config["torch_dtype"] = config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _barrier()


def hf_folder(path: str | os.PathLike) -> Path:
    """The folder of HF safetensors at `path` (a folder, or its only .safetensors file), checked."""
    p = Path(path)
    if not p.exists():
        raise HFError(f"no such file or folder '{p}'")
    folder = p.parent if p.is_file() else p
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFError(f"no *.safetensors files in '{folder}'")
    if p.is_file() and files != [p]:
        raise HFError(f"'{folder}' holds other safetensors files besides '{p.name}'; pass the folder")
    index = folder / INDEX
    if index.is_file():  # a leftover file would be read as well and could shadow the indexed ones
        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        extra = sorted(f.name for f in files if f.name not in listed)
        if extra:
            raise HFError(f"'{folder / extra[0]}' is not listed in {INDEX}; remove it")
    return folder


def config_differences(folder: Path, ours: dict) -> list[str]:
    """Settings in folder/config.json that differ from `ours` (the family's hf_config) but shapes cannot show."""
    path = folder / "config.json"
    if not path.is_file():
        return []
    theirs = json.loads(path.read_text())
    skip = {"architectures", "torch_dtype", "dtype", "max_position_embeddings", "vocab_size", "rope_theta"}
    out = [f"{k}={theirs[k]!r} (ours {v!r})" for k, v in ours.items()
           if k not in skip and isinstance(v, (int, float, str, bool)) and k in theirs and theirs[k] != v]
    # transformers 5 keeps rope_theta inside rope_parameters; 4.x beside rope_scaling (null when unscaled).
    rope = {"rope_type": "default", **({"rope_theta": theirs["rope_theta"]} if "rope_theta" in theirs else {}),
            **(theirs.get("rope_parameters") or theirs.get("rope_scaling") or {})}
    for k, v in (ours.get("rope_parameters") or {}).items():
        if rope.get(k, v) != v:
            out.append(f"rope {k}={rope[k]!r} (ours {v!r})")
    return out


@torch.no_grad()
def load_hf(model: nn.Module, path: str | os.PathLike, family: str = "llama3", strict: bool = True) -> None:
    """Load HF safetensors (one file or sharded with an index) into `model` in place; every rank calls it.

    Plain or DTensor parameters alike: each rank reads only its own shards. `strict=False` ignores
    checkpoint tensors the model lacks (a pipeline stage holding some of the layers).
    """
    folder = hf_folder(path)
    reader = HuggingFaceStorageReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    hf = adapter(family)
    args = model.args
    ours = {}  # our name -> the checkpoint's name, for the tensors the family keeps (tied output dropped)
    for name in saved:
        try:
            ours.update(hf.from_hf({name: name}, args))
        except KeyError:
            raise HFError(f"unexpected tensor '{name}' in '{folder}': no {family} parameter maps to it") from None
    state = get_model_state_dict(model)
    for name, value in state.items():
        if name not in ours:
            want = next(iter(hf.to_hf({name: None})))
            raise HFError(f"missing tensor '{want}' (for {name}) in '{folder}'")
        got = tuple(saved[ours[name]].size)
        if got != tuple(value.shape):
            raise HFError(f"shape mismatch for '{ours[name]}' in '{folder}': checkpoint {list(got)}, "
                          f"model {list(value.shape)}")
    if strict:
        unused = sorted(set(ours) - set(state))
        if unused:
            raise HFError(f"unexpected tensor '{ours[unused[0]]}' in '{folder}': the model has no {unused[0]}")
    if _rank0():
        for diff in config_differences(folder, hf.hf_config(args)):
            log.warning(f"{folder / 'config.json'}: {diff}; the weights load, but the model may compute differently")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({ours[k]: v for k, v in state.items()}, storage_reader=reader)
    set_model_state_dict(model, state)
