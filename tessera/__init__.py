"""Tessera: PyTorch-native pretraining. `tessera.from_pretrained(path)` loads a checkpoint for notebooks."""


def __getattr__(name: str):
    if name == "from_pretrained":  # lazily: `import tessera` stays free of torch
        from tessera.pretrained import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
