"""Qwen 3 dense hyper-parameters (published configs). Torch-free, so configs are checked before launch."""

import dataclasses
from dataclasses import dataclass


@dataclass
class Qwen3Args:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128  # set apart from dim / n_heads
    ffn_hidden: int = 3072
    vocab_size: int = 151936  # tiny and debugmodel take the tokenizer's instead
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_seq_len: int = 4096  # length of the RoPE table; set from training.seq_len
    tie_embeddings: bool = False
    rope_scaling: dict | None = None  # YaRN for long context, as transformers' rope_parameters; None = plain

    qk_norm = True  # not fields: per-head RMSNorm of queries and keys before RoPE, no biases, dense FFNs
    attention_bias = False
    moe = None

    def arch(self) -> dict:
        """What the model computes with, to compare two args."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}


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
