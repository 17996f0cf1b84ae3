"""Hugging Face safetensors in and out, for plain or sharded (DTensor) models, through DCP.

Generic: the family's `tessera.models.<family>.hf` module maps names (`to_hf`, `from_hf`), reads config.json
(`args_from_hf_config`: the architecture, which a load must match exactly) and writes it (`hf_config`).
Both directions run on every rank of a job (each rank reads or writes only its own shards) or in one
process without a process group.
"""

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from tessera import models
from tessera.checkpoint import mxfp4, plain, quantization
from tessera.checkpoint.dequantize import DequantizingReader
from tessera.lora import is_adapter

log = logging.getLogger("tessera")
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # as transformers' save_pretrained


class HFError(ValueError):
    """Bad Hugging Face input: the message is one line naming the path, tensor or shape at fault."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _file_index(sizes: dict[str, int], max_shard_bytes: int) -> dict[str, int]:
    """Tensor name -> output file number (1..n), filled in order up to `max_shard_bytes` per file."""
    index, file, used = {}, 1, 0
    for name, size in sizes.items():
        if used and used + size > max_shard_bytes:
            file, used = file + 1, 0
        index[name], used = file, used + size
    return index


def save_hf(model_state: dict | nn.Module, args, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            family: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES, bos_id: int | None = None,
            eos_id: int | None = None, carry_from: str | None = None, tokenizer_from: str | None = None) -> None:
    """Write `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` + `config.json` (and, for a
    language model given the tokenizer's `bos_id`/`eos_id`, `generation_config.json`) to `out_dir`; a diffusers
    model's files under its own names (the adapter's `weights_name`).

    `model_state`: our names -> tensors or DTensors (or the model itself, read with get_model_state_dict);
    under pipeline parallelism, this rank's stages. `family`: by default the one `args` belong to. Every rank
    of a job calls it: each writes its shards under out_dir/sharded, then rank 0 merges them into full tensors
    and removes the shards. `carry_from`: the Hugging Face folder the run started from, whose tensors the family
    keeps out of the model (Qwen 3.5's MTP head) the export writes back unchanged. `tokenizer_from`: the run's
    tokenizer folder (model.hf_assets_path), whose tokenizer files a language model's export carries.
    """
    # Plain tensors: safetensors knows no training wrapper (float8, MX).
    is_model = isinstance(model_state, nn.Module)
    model_state = plain.model_state(model_state) if is_model else plain.plain_state(model_state)
    model_state = {**model_state, **by_experts(model_state)}
    family = family or models.family_of(args).name
    hf = models.family(family).hf
    names = bound(hf, args)
    # Packed: safetensors writes contiguous tensors only, and an adapter may hand views (a transposed layout).
    state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).contiguous()
             for k, v in names.to_hf(model_state).items()}
    # Integer tensors (DeepSeek V4's hash routing tables: buffers, whole on every rank that holds them) go to files
    # of their own, each written by the first rank holding it: torch's consolidation of DCP's shards sizes
    # floating-point tensors only.
    integers = {k: v for k, v in state.items() if not v.is_floating_point()}
    state = {k: v for k, v in state.items() if k not in integers}
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}  # global sizes, also for DTensors
    owners = dict.fromkeys(integers, 0)
    if dist.is_initialized():  # the file index covers every rank's tensors (pipeline stages hold different ones)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (sizes, sorted(integers)))
        sizes = {k: v for part, _ in gathered for k, v in part.items()}
        owners = {}
        for rank, (_, names) in enumerate(gathered):
            owners.update({n: rank for n in names if n not in owners})
    out = Path(out_dir)
    if _rank0():  # stale shards or files of an earlier export would be merged into or read with this one
        shutil.rmtree(out / "sharded", ignore_errors=True)
        for old in [*out.glob("model-*-of-*.safetensors"), *out.glob("model-integers-*.safetensors"), out / INDEX,
                    out / CARRIED]:
            old.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=_file_index(sizes, max_shard_bytes),
                                      save_distributed=True, enable_consolidation=True)
    with warnings.catch_warnings():  # "torch.distributed is disabled ..." in a single process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer)  # rank 0 has consolidated when this returns on any rank
    rank = dist.get_rank() if dist.is_initialized() else 0
    if mine := {k: v.cpu().contiguous() for k, v in integers.items() if owners[k] == rank}:
        from safetensors.torch import save_file

        save_file(mine, out / _integers(rank), metadata={"format": "pt"})
    if _rank0():
        shutil.rmtree(out / "sharded", ignore_errors=True)
        config = hf.hf_config(args, bos_id=bos_id, eos_id=eos_id)
        diffusers = getattr(hf, "weights_name", "model") != "model"
        if not diffusers:  # diffusers' from_pretrained refuses a dtype key
            config["torch_dtype"] = config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if bos_id is not None and eos_id is not None and not diffusers:  # a language model's sampling defaults
            generation = {"bos_token_id": bos_id, "eos_token_id": eos_id}
            (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if diffusers:
            _rename_weights(out, hf.weights_name)
        if owners:
            _index(out, {name: _integers(rank) for name, rank in owners.items()})
        if carry_from:
            _carry(hf, Path(carry_from), out, dtype)
        if tokenizer_from and not diffusers:
            _copy_tokenizer(Path(tokenizer_from), out)
    _barrier()


# transformers' tokenizer files (fast and slow tokenizers, their special tokens and chat templates)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def _copy_tokenizer(source: Path, out: Path) -> None:
    """The tokenizer files in `source`, so that the export loads with the tokenizer it was trained with wherever a
    Hugging Face folder does (transformers' AutoTokenizer, lm-eval's `hf` model, tessera.eval)."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def _integers(rank: int) -> str:
    return f"model-integers-{rank:05d}.safetensors"


def _index(out: Path, files: dict[str, str]) -> None:
    """{tensor name: its file} entered in `out`'s index."""
    index = json.loads((out / INDEX).read_text())
    index["weight_map"].update(files)
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


CARRIED = "model-carried.safetensors"


def _carry(hf, source: Path, out: Path, dtype: torch.dtype | None) -> None:
    """The tensors of the Hugging Face folder a run started from that its family keeps out of the model but its
    releases hold (the adapter's `carried`: Qwen 3.5's MTP head), written unchanged beside the export's own, with
    the config.json keys that describe them; said in one line (they were not trained)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    what = getattr(hf, "carried", None)
    if what is None or not (source / "config.json").is_file():
        return
    theirs = json.loads((source / "config.json").read_text())
    text = theirs.get("text_config", theirs)  # a multimodal release's text model
    if theirs.get("quantization_config") or text.get("quantization_config"):
        log.warning(f"{out}: the {what.what} of {source} is not written: that folder is quantized")
        return
    carried = {}
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(file, "pt") as fh:
            carried.update({n: fh.get_tensor(n) for n in fh.keys() if n.startswith(what.prefix)})
    if not carried:
        return
    save_file({n: t.to(dtype or t.dtype).contiguous() for n, t in carried.items()}, out / CARRIED,
              metadata={"format": "pt"})
    _index(out, dict.fromkeys(carried, CARRIED))
    config = json.loads((out / "config.json").read_text())
    config.update({k: text[k] for k in what.config_keys if k in text})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log.warning(f"{out}: the {what.what} of {source} ({len(carried)} tensors) written back unchanged: Tessera "
                f"does not train it")


def _rename_weights(out: Path, name: str) -> None:
    """model-*.safetensors and their index as `name`-*.safetensors (diffusers looks for its own file names)."""
    index = json.loads((out / INDEX).read_text())
    for old in sorted(set(index["weight_map"].values())):
        (out / old).rename(out / old.replace("model", name, 1))
    index["weight_map"] = {k: v.replace("model", name, 1) for k, v in index["weight_map"].items()}
    (out / f"{name}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / INDEX).unlink()


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


@torch.no_grad()
def load_hf(model: nn.Module, path: str | os.PathLike, family: str | None = None, args=None) -> None:
    """Load HF safetensors (one file or sharded with an index) into `model` in place; every rank calls it.

    `model`: the whole model, or under pipeline parallelism a module over this rank's stages with the whole
    model's names; `args`: the whole model's (default `model.args`); `family`: by default theirs. The folder
    must hold exactly that model: its config.json describes the same architecture, and it has every tensor of
    it with its shape, and no other; but for parts the family's adapter lets it lack entirely (DeepSeek's MTP
    depths, which transformers never saves), which stay as initialized, said in one line.
    Plain or DTensor parameters alike: each rank reads only its own shards.
    """
    folder = hf_folder(path)
    args = model.args if args is None else args
    family = family or models.family_of(args).name
    try:  # the folder as it loads, else with the parts it lacks initialized (a model built to train them)
        fits = [models.hf_fit(family, str(folder), train) for train in (False, True)]
    except ValueError as e:
        raise HFError(str(e)) from None
    fit = next((f for f in fits if not models.arch_differences(f.args, args)), fits[0])
    diffs = models.arch_differences(fit.args, args, ("config.json", "model"))
    if diffs:
        raise HFError(f"{folder / 'config.json'} describes another model than the one built, in {len(diffs)} "
                      f"field(s): {'; '.join(diffs)}; build config.json's architecture (leave model.flavor empty)")
    try:  # the quantized weights, checked: a missing or misshapen scale is named before anything is read
        packed = quantization.describe(str(folder))
    except ValueError as e:
        raise HFError(str(e)) from None
    reader = DequantizingReader(str(folder), packed) if packed else HuggingFaceStorageReader(str(folder))
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as e:  # safetensors raises its own error types, for a truncated file or a bad header
        raise HFError(f"cannot read the safetensors files in '{folder}': {type(e).__name__}: {e}") from None
    fam = models.family(family)
    names = bound(fam.hf, args)
    # An adapter may read the model under other names beside other models' tensors (Llama 4's multimodal
    # releases): stored_names maps each stored name to its to_hf name, or to None (not the model's).
    stored = fam.hf.stored_names(saved) if hasattr(fam.hf, "stored_names") else {n: n for n in saved}
    saved = {stored[n]: m for n, m in saved.items() if stored[n] is not None}
    # A model released in one layout and saved by transformers in another reads the folder's.
    to_hf = names.to_hf_for(saved) if hasattr(names, "to_hf_for") else names.to_hf
    if fit.note and _rank0():
        log.warning(f"{folder}: {fit.note}")
    with torch.device("meta"):  # the whole model under the checkpoint's names, as the adapter lays it out
        whole = to_hf(_without(fam.spec().model(args).state_dict(), fit.fresh))
    quantized = mxfp4.packed(saved)
    if quantized and quantization.quantization_config(str(folder)).get("quant_method") != "mxfp4":
        raise HFError(f"'{folder}' holds MXFP4 blocks ('{min(quantized)}{mxfp4.BLOCKS}') but its config.json has no "
                      f"mxfp4 quantization_config; add it or pass dequantized weights")
    parts = {n + suffix for n in quantized for suffix in (mxfp4.BLOCKS, mxfp4.SCALES)}
    sizes = {**{n: tuple(m.size) for n, m in saved.items() if n not in parts},
             **{n: mxfp4.shape(saved, n) for n in quantized}}
    for name in sizes:
        if name not in whole:
            ours = _our_name(names, name, whole)
            raise HFError(f"unexpected tensor '{name}' in '{folder}': " + (
                f"the model built has no {ours}" if ours else f"no {family} parameter maps to it"))
    for name, t in whole.items():
        if name not in sizes:
            ours = _our_name(names, name, whole)
            raise HFError(f"missing tensor '{name}'{f' (for {ours})' if ours else ''} in '{folder}'")
        if sizes[name] != tuple(t.shape):
            raise HFError(f"shape mismatch for '{name}' in '{folder}': checkpoint {list(sizes[name])}, "
                          f"model {list(t.shape)}")
    # This rank's tensors under the checkpoint's names: the model's own (or views of them, for an adapter that
    # splits one of ours into several), filled in place; from_hf then maps them back (stacking, dequantizing).
    state = {k: v for k, v in _without(plain.model_state(model), fit.fresh).items() if not is_adapter(k)}  # the base
    regrouped = by_experts(state)  # adapters read and write whole experts: filled here, then copied back
    targets = to_hf({**state, **regrouped})
    reads = {n: t for n, t in targets.items() if n not in quantized}
    for name in quantized & targets.keys():
        reads.update(mxfp4.parts(targets[name], saved, name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        where = {ours: name for name, ours in stored.items() if ours is not None}
        dcp.load({where.get(n, n): t for n, t in reads.items()}, storage_reader=reader)
    for name in quantized & targets.keys():
        mxfp4.unpack_into(targets[name], reads[name + mxfp4.BLOCKS], reads[name + mxfp4.SCALES])
    # Not strict: the folder was checked to hold every tensor of the model above; what the adapter leaves out
    # is state HF's format has no place for (an expert selection bias), kept as it is.
    loaded = names.from_hf(targets)
    for name, value in regrouped.items():  # filled in place (left out of from_hf's) or stacked anew
        loaded[name] = loaded.get(name, value).redistribute(state[name].device_mesh, state[name].placements)
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))


def bound(hf, args):
    """The adapter's to_hf, from_hf (and to_hf_for) for a model of `args`: `bind(args)`'s where its layout depends on
    the architecture (Qwen3-Next's projections fused per key head), else its own."""
    return hf.bind(args) if hasattr(hf, "bind") else hf


_EXPERTS = re.compile(r"\.experts\.w[123](_bias)?$")


def by_experts(state: dict) -> dict:
    """The stacked routed experts of `state` that FSDP split along another dimension than the experts'
    (parallelism.expert_fsdp_shard), redistributed to be split over experts only, as the adapters read and
    write them (a rank's whole experts)."""
    out = {}
    for name, value in state.items():
        if _EXPERTS.search(name) and isinstance(value, DTensor) and any(
                isinstance(p, Shard) and p.dim != 0 for p in value.placements):
            out[name] = value.redistribute(value.device_mesh, [Shard(0) if isinstance(p, Shard) and p.dim != 0 else p
                                                               for p in value.placements])
    return out


def _without(state: dict, prefixes: tuple[str, ...]) -> dict:
    return {k: v for k, v in state.items() if not k.startswith(prefixes)} if prefixes else state


def _our_name(hf, name: str, known) -> str | None:
    """Our parameter that the checkpoint tensor `name` is (part of), read among the model's other tensors
    `known` (an adapter may need them: DeepSeek tells MTP layers by their own tensors); None if none is."""
    others = dict.fromkeys(n for n in known if n != name)
    try:
        added = hf.from_hf({**others, name: None}).keys() - hf.from_hf(others).keys()
        return next(iter(added)) if len(added) == 1 else next(iter(hf.from_hf({name: None})), None)
    except KeyError:
        return None
