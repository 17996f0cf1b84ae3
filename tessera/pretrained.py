"""Models from what training writes, for inference: `from_pretrained` opens a Hugging Face folder (config.json +
safetensors) or a Tessera checkpoint in one process (`python -m tessera.generate` and a family's own generation,
Flux's images, load through it)."""

import dataclasses
import json
import logging
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp

from tessera import models
from tessera.checkpoint.folder import damage, read_model_record, read_saved_config, resume_point
from tessera.checkpoint.hf import HFError, load_hf
from tessera.config import ConfigError
from tessera.data.tokenizer import build_tokenizer

log = logging.getLogger("tessera")
DEFAULT_MAX_SEQ_LEN = 131072  # RoPE positions from_pretrained builds unless asked for more


def pick_device(name: str) -> torch.device:
    """generate.device: auto = cuda when there is one, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _build(fam, args, device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        model = fam.spec().model(args)
    model.to_empty(device=device)
    model.init_buffers(device)
    return model.eval()


def checkpoint_folder(path: str) -> str:
    """A step folder as is; a dump folder or a checkpoint root: its newest complete checkpoint."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        if problem := damage(path):
            raise ConfigError(f"checkpoint: {problem}")
        return path
    for root in (os.path.join(path, "checkpoint"), path):
        found = resume_point(root) if os.path.isdir(root) else None
        if found is not None:
            return found[1]
    raise ConfigError(f"checkpoint: no complete checkpoint in '{path}' (nor under its checkpoint/ folder)")


def is_hf(path: str, hf: bool | None = None) -> bool:
    """`hf` if given, else whether `path` is a folder holding config.json and no DCP .metadata."""
    return hf if hf is not None else (os.path.isfile(os.path.join(path, "config.json"))
                                      and not os.path.isfile(os.path.join(path, ".metadata")))


def hf_family(path: str):
    """The family of the Hugging Face folder at `path`, from its config.json."""
    config = os.path.join(path, "config.json")
    try:
        with open(config) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise HFError(f"no config.json in '{path}': the weights' architecture is unknown; a Hugging Face folder "
                      f"holds one beside its safetensors") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{config}: {e}") from None
    try:
        return models.family_of_hf_config(data, config)
    except ValueError as e:
        raise HFError(str(e)) from None


def from_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", hf: bool | None = None,
                    max_seq_len: int | None = None, hf_assets_path: str = ""):
    """(model in eval mode on `device`, its tokenizer) from a Hugging Face folder (config.json + safetensors)
    or a Tessera checkpoint: a step folder, a checkpoint root or a dump folder (its newest checkpoint).
    `hf`: which of the two (default: a folder holding config.json and no DCP .metadata is HF);
    `max_seq_len`: positions the RoPE table covers (default: what the checkpoint or config.json says, at most
    DEFAULT_MAX_SEQ_LEN)."""
    path, device = str(path), torch.device(device)
    hf = is_hf(path, hf)
    if hf:
        if problem := damage(path):  # an export of Tessera's
            raise HFError(problem)
        fam = hf_family(path)
        try:
            args = models.hf_args(fam.name, path)
        except ValueError as e:
            raise HFError(str(e)) from None
        assets = hf_assets_path or (path if os.path.isfile(os.path.join(path, "tokenizer.json")) else "")
    else:
        path = checkpoint_folder(path)
        record = read_model_record(path)
        if record is None:
            raise ConfigError(f"checkpoint: '{path}' records no architecture (model.json); it predates them, so "
                              f"convert it with python -m tessera.convert dcp-to-hf and load that")
        name, args = models.args_from_json(record)
        fam = models.family(name)
        assets = hf_assets_path or read_saved_config(path).get("model", {}).get("hf_assets_path", "")
    if not max_seq_len and args.max_seq_len > DEFAULT_MAX_SEQ_LEN:  # Llama 4's 10M positions: a 15 GB table
        log.info(f"RoPE table for {DEFAULT_MAX_SEQ_LEN:,} of the model's {args.max_seq_len:,} positions; pass "
                 f"max_seq_len for more")
        max_seq_len = DEFAULT_MAX_SEQ_LEN
    if max_seq_len:
        args = dataclasses.replace(args, max_seq_len=max_seq_len)
    model = _build(fam, args, device)
    if hf:
        load_hf(model, path, family=fam.name)
    else:
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    return model, build_tokenizer(assets)
