"""Model families. Each has `args.py` (torch-free flavors), `model.py`, `parallelize.py`, and `spec.py` tying them."""

import importlib

FAMILIES = ("llama3",)


def flavors(name: str) -> dict:
    return importlib.import_module(f"tessera.models.{name}.args").FLAVORS


def takes_tokenizer_vocab(name: str) -> set:
    return importlib.import_module(f"tessera.models.{name}.args").TAKES_TOKENIZER_VOCAB


def family(name: str):
    """The family's spec module: FLAVORS, Transformer, parallelize (imports torch)."""
    return importlib.import_module(f"tessera.models.{name}.spec")
