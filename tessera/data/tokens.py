"""Prepared datasets on disk: what `python -m tessera.data.prepare` writes and training memory-maps. Torch-free.

    DIR/manifest.json                 written last (no manifest: not prepared): format, tokenizer fingerprint, token
                                      dtype, sources, and for each split its shards in order with their counts
    DIR/<split>/<task>-<part>.bin     the split's tokens: its documents one after another, each [bos] + text + [eos],
                                      uint16 when the vocabulary fits in 16 bits, else uint32
    DIR/<split>/<task>-<part>.idx     int64: where each document of the .bin starts, and its end (documents + 1)

A split is the concatenation of its shards in the manifest's order: one token stream, addressed by position.
"""

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tessera.data.records import DataError

FORMAT, VERSION = "tessera-tokens", 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
OPEN_SHARDS = 64  # shards a reader keeps mapped at once
WORK = ".prepare"  # a prepare's own state (request, task summaries, progress, the executor's logs), kept after it


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2 ** 16 else np.uint32)


def tokenizer_fingerprint(hf_assets_path: str) -> str:
    """What identifies a tokenizer's ids: the sha256 of its tokenizer.json, or "byte" for the built-in one."""
    if not hf_assets_path:
        return "byte"
    return "sha256:" + hashlib.sha256(Path(hf_assets_path, "tokenizer.json").read_bytes()).hexdigest()


def is_prepared(path: str) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, MANIFEST))


def read_manifest(folder: str, key: str = "training.dataset_path") -> dict:
    """The manifest of a prepared folder, or one DataError line saying what `folder` is instead."""
    file = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise DataError(f"{key}: no folder {folder!r}; prepare one with python -m tessera.data.prepare --input ... "
                        f"--output {folder}")
    if not os.path.isfile(file):
        why = ("its prepare did not finish; run the same prepare command again to complete it"
               if os.path.isdir(os.path.join(folder, WORK)) else
               f"prepare it with python -m tessera.data.prepare --input ... --output {folder}, or use "
               f"training.dataset = 'files' for raw text")
        raise DataError(f"{key}: {folder} is not a prepared dataset (no {MANIFEST}); {why}")
    try:
        with open(file, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{key}: {file} is not valid JSON ({e}); prepare the folder again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{key}: {file} is not a Tessera token manifest (no \"format\": \"{FORMAT}\")")
    if manifest.get("version") != VERSION:
        raise DataError(f"{key}: {file} has format version {manifest.get('version')}, this Tessera reads {VERSION}; "
                        f"prepare the folder again")
    return manifest


class TokenShards:
    """One split of a prepared folder as one token stream, memory-mapped: reading a range touches only its bytes.
    Opening checks that every shard is there with the size the manifest gives it (a stat each; `check=False`
    skips that, for ranks whose launch checked it already)."""

    def __init__(self, folder: str, manifest: dict, split: str, key: str = "training.dataset_path",
                 check: bool = True):
        self.folder, self.split = folder, split
        self.dtype = np.dtype(manifest["dtype"])
        self.masked = bool(manifest.get("examples"))  # chat / prompt-completion: a loss mask beside the tokens
        shards = manifest["splits"].get(split, {}).get("shards", [])
        for shard in shards if check else ():
            check_shard(folder, shard, self.dtype, key, self.masked)
        self.files = [os.path.join(folder, s["file"]) for s in shards]
        self.bounds = np.cumsum([0] + [s["tokens"] for s in shards], dtype=np.int64)
        self.tokens = int(self.bounds[-1])
        self.documents = sum(s["documents"] for s in shards)
        self._maps: OrderedDict[tuple[int, str], np.memmap] = OrderedDict()
        self.bytes_read = 0

    def _map(self, k: int, suffix: str = ".bin") -> np.memmap:
        """Shard k's tokens (or its .mask), memory-mapped; the most recently used `OPEN_SHARDS` stay mapped (each
        holds a descriptor)."""
        if (k, suffix) in self._maps:
            self._maps.move_to_end((k, suffix))
        else:
            self._maps[k, suffix] = np.memmap(self.files[k].removesuffix(".bin") + suffix,
                                              dtype=self.dtype if suffix == ".bin" else np.uint8, mode="r")
            if len(self._maps) > OPEN_SHARDS:
                self._maps.popitem(last=False)
        return self._maps[k, suffix]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the stream (0 <= start, start + n <= tokens), across shard ends; in masked
        data each untrained token as ~id (int64, tessera/data/masks.py)."""
        out = self._read(start, n, ".bin")
        if self.masked:
            out = np.where(self._read(start, n, ".mask").astype(bool), out.astype(np.int64), ~out.astype(np.int64))
        return out

    def _read(self, start: int, n: int, suffix: str) -> np.ndarray:
        pieces, end = [], start + n
        k = int(np.searchsorted(self.bounds, start, side="right")) - 1
        while start < end:
            stop = min(end, int(self.bounds[k + 1]))
            pieces.append(self._map(k, suffix)[start - self.bounds[k]:stop - self.bounds[k]])
            start, k = stop, k + 1
        out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        self.bytes_read += out.nbytes
        return out


def check_shard(folder: str, shard: dict, dtype: np.dtype, key: str, masked: bool = False) -> None:
    """A shard's token, index (and loss mask) files exist with the sizes its manifest entry gives."""
    files = [(".bin", shard["tokens"] * dtype.itemsize), (".idx", (shard["documents"] + 1) * 8)]
    for suffix, want in files + ([(".mask", shard["tokens"])] if masked else []):
        path = os.path.join(folder, shard["file"].removesuffix(".bin") + suffix)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise DataError(f"{key}: shard {path} is missing; the manifest lists it. Copy the whole prepared folder "
                            f"again, or prepare it again") from None
        if size != want:
            raise DataError(f"{key}: shard {path} is {'truncated' if size < want else 'too long'}: {size} bytes, the "
                            f"manifest says {want}; copy it again, or prepare the folder again")


# --- a run's prepared data: training.dataset = tokenized (or files pointing at a prepared folder) ---------------

def wanted(t) -> bool:
    """Whether the run's `training` section asks for prepared data."""
    return t.dataset == "tokenized" or (t.dataset == "files" and is_prepared(t.dataset_path))


def parse_mix(mix: str) -> list[tuple[str, float]]:
    """'web:0.7,code:0.2' -> [(name, weight)]; one DataError line for anything else."""
    entries, key = [], "training.dataset_mix"
    for item in (part.strip() for part in mix.split(",") if part.strip()):
        name, colon, weight = item.rpartition(":")
        try:
            value = float(weight) if colon and name.strip() else None
        except ValueError:
            value = None
        if value is None:
            raise DataError(f"{key}: {item!r} is not NAME:WEIGHT; write e.g. web:0.7,code:0.2,math:0.1 (or a TOML "
                            f"table [training.dataset_mix] with web = 0.7 ...)")
        if not (value > 0 and np.isfinite(value)):
            raise DataError(f"{key}: {name.strip()!r} has weight {weight}; weights must be positive numbers")
        entries.append((name.strip(), value))
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        raise DataError(f"{key}: {', '.join(sorted({n for n in names if names.count(n) > 1}))} named twice")
    return entries


def sources(t) -> list[tuple[str, str, float, str]]:
    """(name, folder, weight, the option that named it) of each prepared dataset the run reads."""
    if t.dataset_mix and t.dataset != "tokenized":
        raise DataError(f"training.dataset_mix: mixes prepared datasets, but training.dataset = {t.dataset!r}; set "
                        f"training.dataset = 'tokenized'")
    if t.dataset_mix:
        return [(name, os.path.join(t.dataset_path, name) if t.dataset_path else name, weight,
                 "training.dataset_mix") for name, weight in parse_mix(t.dataset_mix)]
    if not t.dataset_path:
        raise DataError("training.dataset_path: empty, but training.dataset = 'tokenized' reads a prepared folder "
                        "(python -m tessera.data.prepare --output DIR); name it, or set training.dataset_mix")
    return [(os.path.basename(os.path.normpath(t.dataset_path)), t.dataset_path, 1.0, "training.dataset_path")]


def describe_tokenizer(fingerprint: str, path: str = "") -> str:
    if fingerprint == "byte":
        return "the built-in byte tokenizer"
    return f"tokenizer.json {fingerprint.removeprefix('sha256:')[:12]}...{f' ({path})' if path else ''}"


def check(cfg) -> None:
    """Before launch: every prepared folder the run reads is whole, made by the run's tokenizer, and holds a window
    of its training split (and of its validation split when validation is on)."""
    t, window = cfg.training, cfg.training.seq_len + 1
    run_tokenizer = tokenizer_fingerprint(cfg.model.hf_assets_path)
    for _, folder, _, key in sources(t):
        manifest = read_manifest(folder, key)
        made_as = (manifest.get("examples") or {}).get("kind", "text")
        if made_as != t.dataset_format:
            raise DataError(f"training.dataset_format: {t.dataset_format!r}, but {folder} was prepared from "
                            f"{made_as} data; set --training.dataset_format {made_as}, or prepare it again with "
                            f"--format {t.dataset_format}")
        made_by = manifest["tokenizer"]["fingerprint"]
        if made_by != run_tokenizer:
            theirs = describe_tokenizer(made_by, manifest["tokenizer"]["path"])
            ours = describe_tokenizer(run_tokenizer, cfg.model.hf_assets_path)
            raise DataError(f"{key}: {folder} was prepared with {theirs}, but this run tokenizes with {ours} "
                            f"(model.hf_assets_path); train with the tokenizer it was made with, or prepare it again "
                            f"with --tokenizer {cfg.model.hf_assets_path or repr('')}")
        for split in ("train", "validation") if cfg.validation.enable else ("train",):
            tokens = TokenShards(folder, manifest, split, key).tokens
            if tokens < window:
                option, fix = (("training.seq_len", "prepare more data") if split == "train" else
                               ("validation.enable", "prepare more data (with --validation_every > 0), or set "
                                                     "validation.enable = false"))
                raise DataError(f"{option}: the {split} split of {folder} holds {tokens} tokens, less than one "
                                f"window of seq_len + 1 = {window}; {fix}")


def fingerprint(manifest: dict) -> str:
    """What identifies a prepared folder's token streams (their shards, counts and tokenizer)."""
    blob = json.dumps([manifest["tokenizer"]["fingerprint"], manifest["dtype"], manifest["splits"]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
