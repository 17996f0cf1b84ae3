"""Llama 3 / 3.1 / 3.2 hyper-parameters. Torch-free, so configs are checked before launch."""

from dataclasses import dataclass


@dataclass
class Llama3Args:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int = 8
    vocab_size: int = 128256  # debugmodel takes the tokenizer's instead
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to this
    ffn_dim_multiplier: float = 1.0
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling_factor: float = 0.0  # Llama 3.1 frequency scaling; 0 = none
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    max_seq_len: int = 8192  # length of the RoPE table; set from training.seq_len
    tie_embeddings: bool = False
    head_dim_override: int = 0  # 0: dim // n_heads; Hugging Face configs may set head_dim apart
    ffn_hidden_override: int = 0  # 0: from ffn_dim_multiplier and multiple_of; HF configs give intermediate_size
    attention_bias: bool = False  # biases on q, k, v and o (HF configs may set them)

    qk_norm = False  # not fields: Llama has no query/key norm, and dense FFNs
    moe = None

    @property
    def rope_scaling(self) -> dict | None:
        """Llama 3.1's frequency scaling, as tessera.models.common.rope takes it."""
        if not self.rope_scaling_factor:
            return None
        return {"rope_type": "llama3", "factor": self.rope_scaling_factor, "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_pos}

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_hidden_override:
            return self.ffn_hidden_override
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * -(-hidden // self.multiple_of)

    def arch(self) -> dict:
        """What the model computes with, to compare two args: the sizes, not the recipe that derives them."""
        out = dict(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                   head_dim=self.head_dim, ffn_hidden=self.ffn_hidden, vocab_size=self.vocab_size,
                   norm_eps=self.norm_eps, rope_theta=self.rope_theta, rope_scaling_factor=self.rope_scaling_factor,
                   tie_embeddings=self.tie_embeddings, attention_bias=self.attention_bias)
        if self.rope_scaling_factor:
            out.update(rope_low_freq_factor=self.rope_low_freq_factor, rope_high_freq_factor=self.rope_high_freq_factor,
                       rope_original_max_pos=self.rope_original_max_pos)
        return out


# name: dim, layers, heads, kv heads, ffn multiplier, multiple_of, rope scaling factor, tied embeddings
_TABLE = {
    "tiny": (64, 2, 4, 2, 1.0, 32, 8.0, False),  # for tests: milliseconds per step
    "debugmodel": (256, 6, 16, 8, 1.0, 256, 8.0, False),
    "1B": (2048, 16, 32, 8, 1.5, 256, 32.0, True),
    "3B": (3072, 28, 24, 8, 1.0, 256, 32.0, True),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 8.0, False),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 8.0, False),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 8.0, False),
}

FLAVORS = {
    name: Llama3Args(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, ffn_dim_multiplier=m, multiple_of=mo,
                     rope_scaling_factor=rs, tie_embeddings=tie)
    for name, (d, n, h, kv, m, mo, rs, tie) in _TABLE.items()
}
TAKES_TOKENIZER_VOCAB = {"tiny", "debugmodel"}
