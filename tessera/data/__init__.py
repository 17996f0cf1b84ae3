"""Data: tokenizers, document sources and the packing token loader.

The loader needs torch; it is imported lazily so tokenizers and sources stay usable without it.
"""

from tessera.data.sources import documents
from tessera.data.tokenizer import build_tokenizer

__all__ = ["TokenLoader", "build_dataloader", "build_tokenizer", "documents"]


def __getattr__(name: str):
    if name in ("TokenLoader", "build_dataloader"):
        from tessera.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
