"""Qwen 3.5's hyper-parameters, shared by its dense family (tessera/models/qwen3_5/dense), its MoE family
(qwen3_5_moe) and Qwen3-Next (both MoE ones build on `Qwen35MoeArgs`): a hybrid of Gated DeltaNet blocks and gated
full-attention blocks (`layer_types`). Torch-free."""

import dataclasses
from dataclasses import dataclass, field

from tessera.models.common.moe_args import MoEArgs

LINEAR, FULL = "linear_attention", "full_attention"


def every_fourth_full(n_layers: int, interval: int = 4) -> list[str]:
    """transformers' default pattern: blocks interval-1, 2 interval-1, ... are full attention, the rest DeltaNet."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]


@dataclass
class Qwen35Args:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 16  # full attention's query heads
    n_kv_heads: int = 4
    head_dim: int = 256
    ffn_hidden: int = 12288
    vocab_size: int = 248320  # the debug flavors take the tokenizer's instead
    norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25  # RoPE turns the first head_dim * this of each head, the rest pass
    max_seq_len: int = 4096  # length of the RoPE table; set from training.seq_len
    tie_embeddings: bool = False
    linear_k_heads: int = 16  # DeltaNet's query/key heads
    linear_v_heads: int = 32  # its value heads (a multiple of the key heads)
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    conv_kernel: int = 4  # the causal depthwise convolution's width
    layer_types: list[str] = field(default_factory=list)  # per block: linear_attention or full_attention; empty:
    # every fourth block full (transformers' default)

    qk_norm = True  # not fields: the full-attention blocks' per-head q/k RMSNorm, no biases, an output gate
    attention_bias = False
    rope_scaling = None
    moe = None

    def __post_init__(self):
        self.layer_types = list(self.layer_types) or every_fourth_full(self.n_layers)
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types = {self.layer_types!r}: one of {LINEAR!r} or {FULL!r} per block "
                             f"({self.n_layers})")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def linear(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == LINEAR

    def arch(self) -> dict:
        """What the model computes with, to compare two args."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}


@dataclass
class Qwen35MoeArgs(Qwen35Args):
    n_experts: int = 256
    top_k: int = 8
    moe_hidden: int = 512  # each routed expert's SwiGLU hidden size
    shared_hidden: int = 512  # the gated shared expert's

    @property
    def moe(self) -> MoEArgs:  # every block has experts; top-k weights renormalized (transformers always does)
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden, route_norm=True)

    def arch(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("max_seq_len", "ffn_hidden")}


def param_role(name: str, shape: tuple[int, ...]) -> str | None:
    """The DeltaNet's convolution taps [channels, K] are a filter per channel, not a linear map: a vector's role
    (AdamW, no weight decay under weight_decay_exclude), not Muon's."""
    return "vector" if ".attention.heads.conv_" in name else None
