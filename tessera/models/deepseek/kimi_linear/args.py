"""Kimi Linear hyper-parameters and flavors: DeepSeek V3's MLA (without RoPE: NoPE) and DeepSeek MoE, and Kimi
Delta Attention (KDA) in most blocks (`layer_types`). Torch-free.

"48B-A3B" is moonshotai/Kimi-Linear-48B-A3B's released config.json (Base and Instruct share it): 27 blocks, MLA in
blocks 4, 8, ..., 24 and 27 (counted from 1, its linear_attn_config), KDA in the rest, 256 experts of which 8 route
and a shared one, block 1 dense."""

from dataclasses import dataclass, field

from tessera.models.deepseek.args import DeepSeekV3Args

LINEAR, FULL = "linear_attention", "full_attention"


def default_layer_types(n_layers: int) -> list[str]:
    """transformers' default without a pattern: MLA in blocks 4, 8, ... (counted from 0, not block 0), KDA else."""
    return [FULL if i and i % 4 == 0 else LINEAR for i in range(n_layers)]


@dataclass
class KimiLinearArgs(DeepSeekV3Args):
    linear_heads: int = 32  # KDA's heads (q, k and v alike)
    linear_head_dim: int = 128  # their size (keys' and values'), and the rank of its gates' low-rank projections
    conv_kernel: int = 4  # the causal depthwise convolution's width
    layer_types: list[str] = field(default_factory=list)  # per block: linear_attention (KDA) or full_attention
    # (MLA); empty: transformers' default (default_layer_types)

    mla_rope = False  # not a field: Kimi Linear's MLA has no RoPE

    def __post_init__(self):
        self.layer_types = list(self.layer_types) or default_layer_types(self.n_layers)
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types = {self.layer_types!r}: one of {LINEAR!r} or {FULL!r} per block "
                             f"({self.n_layers})")

    def linear(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == LINEAR

    # What the estimate reads of a hybrid's linear layers (tessera.estimate.cost): KDA's heads are its key and
    # value heads alike.
    @property
    def linear_k_heads(self) -> int:
        return self.linear_heads

    @property
    def linear_v_heads(self) -> int:
        return self.linear_heads

    @property
    def linear_k_dim(self) -> int:
        return self.linear_head_dim

    @property
    def linear_v_dim(self) -> int:
        return self.linear_head_dim


def _full(n_layers: int, *one_based: int) -> list[str]:
    return [FULL if i + 1 in one_based else LINEAR for i in range(n_layers)]


_MLA_MOE = dict(q_lora_rank=0, score_func="sigmoid", n_groups=1, top_groups=1, rope_interleave=False, norm_eps=1e-5)
FLAVORS = {
    # for tests and CPU runs: each of two pipeline stages holds both mixers; block 0 dense, the others MoE
    "debugmodel": KimiLinearArgs(dim=64, n_layers=4, n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                                 qk_rope_head_dim=8, v_head_dim=16, ffn_hidden=96, moe_hidden=32, n_experts=8,
                                 n_shared=1, top_k=2, route_scale=2.446, first_k_dense=1, vocab_size=0,
                                 linear_heads=4, linear_head_dim=16, layer_types=_full(4, 2, 4), **_MLA_MOE),
    "48B-A3B": KimiLinearArgs(dim=2304, n_layers=27, n_heads=32, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, ffn_hidden=9216, moe_hidden=1024, n_experts=256,
                              n_shared=1, top_k=8, route_scale=2.446, first_k_dense=1, vocab_size=163840,
                              linear_heads=32, linear_head_dim=128, layer_types=_full(27, 4, 8, 12, 16, 20, 24, 27),
                              **_MLA_MOE),
}
TAKES_TOKENIZER_VOCAB = {"debugmodel"}
