"""Data: tokenizers, document sources and the packing token loader.

The loader needs torch; it is imported lazily so tokenizers and sources stay usable without it.
"""

from tessera.data.sources import documents
from tessera.data.tokenizer import build_tokenizer

__all__ = ["build_tokenizer", "documents"]  # and, imported on first use, TokenLoader and build_dataloader
_LAZY = ("TokenLoader", "build_dataloader")


def __getattr__(name: str):
    if name in _LAZY:
        from tessera.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
