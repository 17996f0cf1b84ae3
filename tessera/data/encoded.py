"""Precomputed outputs of a family's frozen encoders (what `python -m tessera.cache` writes; Flux's latents): per
example a few tensors, its columns, CHUNK examples a file, `<folder>/<split>/<chunk:06d>.pt` holding {column:
tensor [examples, ...]} of examples chunk x CHUNK onwards, so a reader holds one chunk at a time."""

import os
from collections.abc import Callable

import torch

CHUNK = 1024


def chunk_path(folder: str, split: str, chunk: int) -> str:
    return os.path.join(folder, split, f"{chunk:06d}.pt")


def write_split(folder: str, split: str, n: int, encode: Callable[[list[int]], dict], batch: int = 64) -> int:
    """Examples 0 .. n - 1 of `split`, `encode`d `batch` at a time ({column: tensor [len(ids), ...]}), into
    `folder`; returns the chunks written."""
    os.makedirs(os.path.join(folder, split), exist_ok=True)
    chunks = 0
    for start in range(0, n, CHUNK):
        ids = list(range(start, min(n, start + CHUNK)))
        parts = [encode(ids[i:i + batch]) for i in range(0, len(ids), batch)]
        columns = {k: torch.cat([p[k] for p in parts]).cpu() for k in parts[0]}
        torch.save(columns, chunk_path(folder, split, start // CHUNK))
        chunks += 1
    return chunks
