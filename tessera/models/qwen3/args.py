"""Qwen 3's hyper-parameters, shared by its dense family (tessera/models/qwen3/dense) and its MoE family
(tessera/models/qwen3/moe, the same model line: these fields plus the experts). Torch-free."""

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
