"""Qwen 3 dense hyper-parameters (published configs). Torch-free, so configs are checked before launch."""

from tessera.models.qwen3.args import Qwen3Args

# name: dim, layers, heads, kv heads, head_dim, ffn hidden, tied embeddings
_TABLE = {
    "tiny": (64, 2, 4, 2, 16, 192, False),  # for tests: milliseconds per step
    "debugmodel": (256, 6, 8, 4, 64, 768, False),
    "0.6B": (1024, 28, 16, 8, 128, 3072, True),
    "1.7B": (2048, 28, 16, 8, 128, 6144, True),
    "4B": (2560, 36, 32, 8, 128, 9728, True),
    "8B": (4096, 36, 32, 8, 128, 12288, False),
    "14B": (5120, 40, 40, 8, 128, 17408, False),
    "32B": (5120, 64, 64, 8, 128, 25600, False),
}

FLAVORS = {name: Qwen3Args(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, ffn_hidden=f, tie_embeddings=t)
           for name, (d, n, h, kv, hd, f, t) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"tiny", "debugmodel"}
