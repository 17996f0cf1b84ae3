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


def num_params(model, exclude_embedding: bool = False) -> int:
    """Parameters; without the input embedding (a lookup, no FLOPs) unless it doubles as the output."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding and getattr(model, "output", None) is not None:
        n -= model.tok_embeddings.weight.numel()
    return n
