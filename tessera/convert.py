"""Convert checkpoints, in one process.

    python -m tessera.convert dcp-to-hf   STEP_DIR HF_DIR  [--model.name N] [--model.flavor F] [--dtype bfloat16]
    python -m tessera.convert hf-to-dcp   HF_DIR STEP_DIR  [--model.name N] [--model.flavor F] [--dtype bfloat16]
    python -m tessera.convert dcp-to-torch STEP_DIR OUT.pt

The model comes from STEP_DIR/config.toml when there is one (flags override it), else from the flags; for
hf-to-dcp without --model.flavor, the flavor whose shapes match HF_DIR/config.json. Flavors that take the
tokenizer's vocab take the checkpoint's embedding rows instead.
"""

import argparse
import dataclasses
import json
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tessera import models
from tessera.checkpoint.hf import HFError, adapter, hf_folder, load_hf, save_hf
from tessera.checkpoint.manager import write_marker
from tessera.config import ConfigError, parse_args, to_toml

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBED = "tok_embeddings.weight"


def _config(src: Path | None, opts: argparse.Namespace):
    argv = ["--job.config_file", str(src / "config.toml")] if src and (src / "config.toml").is_file() else []
    for key in ("model.name", "model.flavor"):
        if getattr(opts, key) is not None:
            argv += [f"--{key}", getattr(opts, key)]
    cfg = parse_args(argv)
    if cfg.model.flavor not in models.flavors(cfg.model.name):
        raise ConfigError(f"model.flavor: unknown {cfg.model.name} flavor '{cfg.model.flavor}'; one of "
                          f"{', '.join(models.flavors(cfg.model.name))}")
    return cfg


def _build(cfg, vocab_rows: int):
    family = models.family(cfg.model.name)
    args = dataclasses.replace(family.FLAVORS[cfg.model.flavor], max_seq_len=cfg.training.seq_len)
    if cfg.model.flavor in family.TAKES_TOKENIZER_VOCAB:
        args = dataclasses.replace(args, vocab_size=vocab_rows)
    with torch.device("meta"):
        model = family.Transformer(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    return model, args


def _match_flavor(name: str, hf_dir: Path) -> str | None:
    """The flavor whose config.json equals HF_DIR's in every shape-deciding field, or None."""
    path = hf_dir / "config.json"
    if not path.is_file():
        return None
    theirs = json.loads(path.read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "tie_word_embeddings")
    hf = adapter(name)
    for flavor, args in models.flavors(name).items():
        ours = hf.hf_config(args)
        if all(ours[k] == theirs.get(k, False if k == "tie_word_embeddings" else None) for k in keys):
            return flavor
    raise HFError(f"no {name} flavor matches {path} ({', '.join(f'{k}={theirs.get(k)}' for k in keys)}); "
                  f"pass --model.flavor")


def dcp_to_hf(src: Path, dst: Path, opts) -> None:
    if not (src / ".metadata").is_file():
        raise HFError(f"'{src}' is not a DCP checkpoint (no .metadata)")
    cfg = _config(src, opts)
    saved = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    if f"model.{EMBED}" not in saved:
        raise HFError(f"'{src}' holds no model.{EMBED}: not a Tessera checkpoint")
    model, args = _build(cfg, saved[f"model.{EMBED}"].size[0])
    state = model.state_dict()
    for name, value in state.items():
        if f"model.{name}" not in saved:
            raise HFError(f"missing tensor 'model.{name}' in '{src}' (model {cfg.model.name} {cfg.model.flavor})")
        if tuple(saved[f"model.{name}"].size) != tuple(value.shape):
            raise HFError(f"shape mismatch for 'model.{name}' in '{src}': checkpoint "
                          f"{list(saved[f'model.{name}'].size)}, model {list(value.shape)} "
                          f"({cfg.model.name} {cfg.model.flavor})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=str(src))
    save_hf(state, args, dst, dtype=opts.dtype, family=cfg.model.name)


def hf_to_dcp(src: Path, dst: Path, opts) -> None:
    if not src.is_dir():
        raise HFError(f"no such folder '{src}'")
    if getattr(opts, "model.flavor") is None:
        setattr(opts, "model.flavor", _match_flavor(getattr(opts, "model.name") or "llama3", src))
    cfg = _config(None, opts)
    saved = HuggingFaceStorageReader(str(hf_folder(src))).read_metadata().state_dict_metadata
    embed = adapter(cfg.model.name).to_hf({EMBED: None})
    rows = saved[next(iter(embed))].size[0] if next(iter(embed)) in saved else 0
    model, _ = _build(cfg, rows)
    load_hf(model, src, family=cfg.model.name)
    state = model.state_dict()
    if opts.dtype is not None:
        state = {k: v.to(opts.dtype) for k, v in state.items()}
    dst.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(dst))
    (dst / "config.toml").write_text(to_toml(cfg))
    step = re.fullmatch(r"step-(\d+)", dst.name)
    write_marker(str(dst), int(step.group(1)) if step else 0, "model")  # what the trainer's loader checks


def dcp_to_torch(src: Path, dst: Path, opts) -> None:
    if opts.dtype is not None:
        raise HFError("--dtype applies to dcp-to-hf and hf-to-dcp only")
    if not (src / ".metadata").is_file():
        raise HFError(f"'{src}' is not a DCP checkpoint (no .metadata)")
    dcp_to_torch_save(str(src), str(dst))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("dcp-to-hf", "hf-to-dcp", "dcp-to-torch"))
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--model.name", default=None)
    p.add_argument("--model.flavor", default=None)
    p.add_argument("--dtype", choices=DTYPES, default=None)
    opts = p.parse_args(argv)
    opts.dtype = DTYPES.get(opts.dtype)
    if not opts.src.exists():
        p.exit(2, f"{p.prog}: error: no such file or folder '{opts.src}'\n")
    run = {"dcp-to-hf": dcp_to_hf, "hf-to-dcp": hf_to_dcp, "dcp-to-torch": dcp_to_torch}[opts.mode]
    try:
        run(opts.src, opts.dst, opts)
    except (HFError, ConfigError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"wrote {opts.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
