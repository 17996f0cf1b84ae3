"""Convert checkpoints, in one process.

    python -m tessera.convert dcp-to-hf   STEP_DIR HF_DIR  [--model.name N] [--model.flavor F] [--dtype bfloat16]
    python -m tessera.convert hf-to-dcp   HF_DIR STEP_DIR  [--model.name N] [--model.flavor F] [--dtype bfloat16]
    python -m tessera.convert dcp-to-torch STEP_DIR OUT.pt
    python -m tessera.convert MODE SRC DST --model.name N   # a family's own formats (ModelSpec.convert)

Flux's: bfl-to-diffusers, diffusers-to-bfl, bfl-vae-to-diffusers, diffusers-vae-to-bfl (Black Forest Labs'
single files both ways).

The destination must be new or empty; --overwrite replaces it whole, once the conversion has succeeded.

The architecture is what the source records: STEP_DIR/model.json (older checkpoints: the flavor in their
config.toml, flavors that take the tokenizer's vocab taking the embedding rows), or HF_DIR/config.json. A
--model.flavor that differs from it is refused, naming the fields; hf-to-dcp writes model.json beside the
weights, so training resumes exactly that architecture.
"""

import argparse
import dataclasses
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tessera import architecture, models
from tessera.checkpoint.folder import damage
from tessera.checkpoint.hf import HFError, hf_folder, load_hf, save_hf
from tessera.checkpoint.manager import write_marker, write_run_record
from tessera.checkpoint.writer import HashingWriter
from tessera.config import ConfigError
from tessera.dtypes import DTYPES
from tessera.schema import parse_args


def _config(src: Path | None, opts: argparse.Namespace):
    argv = ["--job.config_file", str(src / "config.toml")] if src and (src / "config.toml").is_file() else []
    for key in ("model.name", "model.flavor"):
        if getattr(opts, key) is not None:
            argv += [f"--{key}", getattr(opts, key)]
    cfg = parse_args(argv)
    return cfg, architecture.check_model(cfg)


def _build(fam, args):
    with torch.device("meta"):
        model = fam.spec().model(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    return model


def _refuse_damaged(src: Path) -> None:
    """A source Tessera wrote (it has a marker) is intact, its content checked against the marker's digests."""
    if problem := damage(str(src)):
        raise HFError(problem)


def dcp_to_hf(src: Path, dst: Path, opts) -> None:
    if not (src / ".metadata").is_file():
        raise HFError(f"'{src}' is not a DCP checkpoint (no .metadata)")
    _refuse_damaged(src)
    cfg, fam = _config(src, opts)
    saved = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    embedding = f"model.{fam.embedding}"
    if embedding not in saved:
        raise HFError(f"'{src}' holds no {embedding}: not a Tessera {cfg.model.name} checkpoint")
    args = architecture.resolve(architecture.request(fam, cfg), saved[embedding].size[0], str(src))
    model = _build(fam, args)
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
    c, assets = cfg.checkpoint, cfg.model.hf_assets_path  # the run's: where it started from, its tokenizer
    if assets and not os.path.isdir(assets):
        print(f"python -m tessera.convert: warning: model.hf_assets_path: the run's tokenizer folder '{assets}' (its "
              f"config.toml) is not here; the export carries no tokenizer files", file=sys.stderr)
    save_hf(state, args, dst, dtype=opts.dtype, family=cfg.model.name,
            carry_from=c.initial_load_path if c.initial_load_in_hf and os.path.isdir(c.initial_load_path) else None,
            tokenizer_from=assets if os.path.isdir(assets) else None)


def hf_to_dcp(src: Path, dst: Path, opts) -> None:
    if not src.is_dir():
        raise HFError(f"no such folder '{src}'")
    cfg, fam = _config(None, opts)
    hf_folder(src)
    _refuse_damaged(src)
    try:
        args = dataclasses.replace(models.hf_args(cfg.model.name, str(src)), max_seq_len=cfg.training.seq_len)
    except ValueError as e:
        raise HFError(str(e)) from None
    asked = architecture.asked_args(architecture.request(fam, cfg), args.vocab_size)
    diffs = models.arch_differences(args, asked, ("config.json", "flavor")) if asked is not None else []
    if diffs:
        raise ConfigError(f"model.flavor: '{cfg.model.flavor}' and {src / 'config.json'} differ in {len(diffs)} "
                          f"field(s): {'; '.join(diffs)}; leave --model.flavor out to convert config.json's model")
    model = _build(fam, args)
    load_hf(model, src, family=cfg.model.name)
    state = model.state_dict()
    if opts.dtype is not None:
        state = {k: v.to(opts.dtype) for k, v in state.items()}
    dst.mkdir(parents=True, exist_ok=True)
    writer = HashingWriter(dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, storage_writer=writer)
    digests = {**writer.digests, **write_run_record(str(dst), cfg, args)}
    step = re.fullmatch(r"step-(\d+)", dst.name)
    write_marker(str(dst), int(step.group(1)) if step else 0, "model", digests)  # what the trainer's loader checks


def dcp_to_torch(src: Path, dst: Path, opts) -> None:
    if opts.dtype is not None:
        raise HFError("--dtype applies to dcp-to-hf and hf-to-dcp only")
    if not (src / ".metadata").is_file():
        raise HFError(f"'{src}' is not a DCP checkpoint (no .metadata)")
    _refuse_damaged(src)
    dcp_to_torch_save(str(src), str(dst))


def _check_destination(src: Path, dst: Path, mode: str, kind: str, overwrite: bool) -> None:
    """Before any work: dst can be written (`kind`: a folder, or a file), and holds nothing unless --overwrite asks
    to replace it."""
    for parent in dst.parents:
        if parent.exists() and not parent.is_dir():
            raise HFError(f"'{parent}' is a file, so '{dst}' cannot be created; give a {kind} path under a folder")
    if kind == "folder" and dst.exists() and not dst.is_dir():
        raise HFError(f"'{dst}' is a file; {mode} writes a folder: give a new or empty folder's path")
    if kind == "file" and dst.is_dir():
        raise HFError(f"'{dst}' is a folder; {mode} writes one file: give its path (e.g. {dst / 'model.pt'})")
    if dst.exists() and (dst.is_file() or any(dst.iterdir())):
        if not overwrite:
            raise HFError(f"'{dst}' already exists{' and is not empty' if dst.is_dir() else ''}; give a new or "
                          f"empty {kind}, or --overwrite to replace it whole")
        if dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents:
            raise HFError(f"--overwrite: '{dst}' holds the source '{src}'; write somewhere else")


def _write_then_replace(run, src: Path, dst: Path, opts) -> None:
    """Convert into a temporary sibling of dst, then put it in dst's place (replacing what --overwrite allowed):
    a failed or interrupted conversion leaves dst as it was."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.converting-", dir=dst.parent))
    try:
        run(src, staging / dst.name, opts)  # the same name: hf-to-dcp reads the step from it
        if dst.is_dir():
            shutil.rmtree(dst)
        elif dst.exists():
            dst.unlink()
        (staging / dst.name).rename(dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _conversion(p: argparse.ArgumentParser, opts) -> tuple[str, object]:
    """(what the mode writes: "file" or "folder", the function (src, dst, opts)): ours, or the family's own."""
    ours = {"dcp-to-hf": ("folder", dcp_to_hf), "hf-to-dcp": ("folder", hf_to_dcp),
            "dcp-to-torch": ("file", dcp_to_torch)}
    if opts.mode in ours:
        return ours[opts.mode]
    name = getattr(opts, "model.name")
    if name not in models.FAMILIES:
        p.exit(2, f"{p.prog}: error: mode '{opts.mode}': not one of {', '.join(ours)}; a family's own conversion "
                  f"needs --model.name (one of {', '.join(models.FAMILIES)})\n")
    theirs = models.family(name).spec().convert
    if opts.mode not in theirs or opts.dtype is not None or getattr(opts, "model.flavor") is not None:
        p.exit(2, f"{p.prog}: error: mode '{opts.mode}' with --model.name {name}: "
                  + ("its conversions take no --dtype or --model.flavor\n" if opts.mode in theirs else
                     f"{name}'s conversions are {', '.join(theirs) or 'none'}; ours {', '.join(ours)}\n"))
    kind, write = theirs[opts.mode]
    return kind, lambda src, dst, _: write(src, dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", help="dcp-to-hf, hf-to-dcp, dcp-to-torch, or one of the family's (--model.name)")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--model.name", default=None)
    p.add_argument("--model.flavor", default=None)
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dst whole (after the conversion succeeded); refused otherwise")
    opts = p.parse_args(argv)
    opts.dtype = DTYPES.get(opts.dtype)
    if not opts.src.exists():
        p.exit(2, f"{p.prog}: error: no such file or folder '{opts.src}'\n")
    kind, run = _conversion(p, opts)
    try:
        _check_destination(opts.src, opts.dst, opts.mode, kind, opts.overwrite)
        _write_then_replace(run, opts.src, opts.dst, opts)
    except (HFError, ConfigError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    except OSError as e:  # what the file system refuses (permissions, a full disk): dst is left as it was
        p.exit(2, f"{p.prog}: error: cannot write '{opts.dst}': {e.strerror or e}\n")
    print(f"wrote {opts.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
