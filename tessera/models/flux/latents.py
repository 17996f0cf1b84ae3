"""Reading precomputed latents (what `python -m tessera.cache` writes, tessera.data.encoded's chunks): per pair,
(x0, T5 features, pooled CLIP embedding)."""

import os

import torch

from tessera.data.encoded import CHUNK, chunk_path
from tessera.data.records import DataError

COLUMNS = ("x0", "txt", "pooled")


class LatentCache:
    def __init__(self, folder: str, split: str):
        self.folder, self.split, self._chunk = folder, split, (None, None)

    def _load(self, chunk: int) -> dict:
        if self._chunk[0] != chunk:
            path = chunk_path(self.folder, self.split, chunk)
            if not os.path.isfile(path):
                raise DataError(f"flux.latent_cache: no {path}; the cache holds fewer pairs than the data: "
                                f"precompute them with python -m tessera.cache, or unset it")
            self._chunk = (chunk, torch.load(path))
        return self._chunk[1]

    def get(self, pair_ids: list[int], device: torch.device):
        rows = [self._load(i // CHUNK) for i in pair_ids]  # one chunk held at a time: pairs are read in order
        parts = [tuple(chunk[k][i % CHUNK] for k in COLUMNS) for chunk, i in zip(rows, pair_ids, strict=True)]
        return tuple(torch.stack(column).to(device) for column in zip(*parts, strict=True))
