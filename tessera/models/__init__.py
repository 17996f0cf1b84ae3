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


def arch_differences(saved, asked, labels: tuple[str, str] = ("checkpoint", "asked")) -> list[str]:
    """The fields of `args.arch()` (what the model computes with; not max_seq_len, the RoPE table's length set
    from training.seq_len) in which two args differ, as 'field: saved (checkpoint) vs asked (asked)'. A field
    one side lacks is moot there (the scaling details of an unscaled RoPE, whose factor already differs)."""
    theirs, ours = saved.arch(), asked.arch()
    return [f"{k}: {theirs[k]!r} ({labels[0]}) vs {ours[k]!r} ({labels[1]})"
            for k in theirs if k in ours and theirs[k] != ours[k]]


def args_to_json(name: str, args) -> dict:
    """What a checkpoint records of its model: `model.json` = {"family": name, "args": {...}}."""
    import dataclasses

    return {"family": name, "args": dataclasses.asdict(args)}


def args_from_json(record: dict) -> tuple[str, object]:
    """(family, args) from a `model.json` record; unknown fields raise TypeError, a missing family KeyError."""
    name = record["family"]
    cls = type(next(iter(flavors(name).values())))
    return name, cls(**record["args"])


def hf_adapter(name: str):
    """The family's Hugging Face adapter module (torch-free for config.json; its tensor maps need no torch)."""
    return importlib.import_module(f"tessera.models.{name}.hf")


def hf_args(name: str, path: str):
    """The architecture the config.json of the Hugging Face folder at `path` (or beside the file `path`)
    describes; ValueError naming the file when it is missing, unreadable, or not one the family computes."""
    import json
    import os

    folder = os.path.dirname(path) if os.path.isfile(path) else path
    config = os.path.join(folder, "config.json")
    try:
        with open(config) as fh:
            return hf_adapter(name).args_from_hf_config(json.load(fh))
    except FileNotFoundError:
        raise ValueError(f"no config.json in '{folder}': the weights' architecture is unknown; a Hugging Face "
                         f"folder holds one beside its safetensors") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{config}: {e}") from None
