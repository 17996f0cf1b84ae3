"""The DeepSeek group's hyper-parameters: multi-head latent attention and DeepSeek MoE (published configs), which
DeepSeek V3's flavors (tessera/models/deepseek/v3/args.py) and Kimi Linear's (its MLA blocks) share. Torch-free, so
configs are checked before launch."""

import dataclasses
from dataclasses import dataclass, field

from tessera.models.common.moe_args import MoEArgs, sparse_layers


@dataclass
class DeepSeekV3Args:
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    q_lora_rank: int = 1536  # the query's low-rank bottleneck; 0: one plain projection
    kv_lora_rank: int = 512  # the latent every head's keys and values are expanded from
    qk_nope_head_dim: int = 128  # the part of each query/key head without RoPE
    qk_rope_head_dim: int = 64  # the part with RoPE; its key is one head shared by all
    v_head_dim: int = 128
    ffn_hidden: int = 18432  # the dense first blocks' SwiGLU
    moe_hidden: int = 2048  # each expert's
    n_experts: int = 256
    n_shared: int = 1
    top_k: int = 8
    score_func: str = "sigmoid"  # V3 sigmoid, V2 softmax
    n_groups: int = 8  # group-limited routing: tokens pick experts within top_groups of n_groups groups
    top_groups: int = 4
    route_scale: float = 2.5  # HF routed_scaling_factor
    norm_topk_prob: bool = True
    first_k_dense: int = 3  # HF first_k_dense_replace
    vocab_size: int = 129280  # debugmodel takes the tokenizer's instead
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # YaRN, as transformers' rope_parameters; None = plain
    rope_interleave: bool = True  # the RoPE dims of the weights come in pairs (HF rope_interleave), not halves
    max_seq_len: int = 4096  # length of the RoPE table; set from training.seq_len
    tie_embeddings: bool = False
    n_mtp: int = 0  # multi-token prediction depths (HF num_nextn_predict_layers): depth k also predicts token i+k+1
    index_topk: int = 0  # DeepSeek V3.2's sparse attention (tessera/models/deepseek/dsa.py): each query attends the
    # keys its indexer ranks highest; 0: dense MLA (V3)
    index_n_heads: int = 64  # the indexer's heads
    index_head_dim: int = 128  # and their size
    index_rope_interleave: bool = False  # GLM-5: the indexer's RoPE dims come in pairs (V3.2's: halves)
    index_shared: list[int] = field(default_factory=list)  # GLM-5: blocks without an indexer, which attend the
    # keys the previous block with one picked (HF indexer_types "shared")

    qk_norm = False  # not fields: the shared decoder's switches
    attention_bias = False
    mla_rope = True  # MLA turns its rope slices (Kimi Linear's MLA: NoPE)

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """A query/key head's size (its values' is v_head_dim)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def takes_ulysses(self) -> bool:
        """DSA's selected keys span the sequence, which Ulysses' head split cannot share out."""
        return not self.index_topk

    def cp_gathered(self, tp: int) -> float | None:
        """Elements per token a block gathers under all-gather CP (tessera.estimate.cost.cp_bytes): DSA's
        latent keys (the latent and the RoPE key, whole on every TP rank) and its indexer's one-head keys, in the
        blocks with an indexer; None: dense MLA's heads, as any attention's."""
        if not self.index_topk:
            return None
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim * (
            1 - len(self.index_shared) / self.n_layers)

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden, n_shared=self.n_shared,
                       score_func=self.score_func, route_norm=self.norm_topk_prob, route_scale=self.route_scale,
                       n_groups=self.n_groups, top_groups=self.top_groups,  # MTP depths: blocks L, L + 1...
                       layers=sparse_layers(self.n_layers + self.n_mtp, dense=range(self.first_k_dense)))

    def arch(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}


def mla_qk_clip(args) -> dict[str, tuple[tuple[int, float], ...]]:
    """MLA's QK-clip (the Kimi K2 report): per head, the query's rows without RoPE and the keys' (from wkv_b) by
    sqrt(gamma), the query's RoPE rows by gamma; the values' rows and the shared RoPE key untouched."""
    query = "wq_b" if args.q_lora_rank else "wq"
    return {query: ((args.qk_nope_head_dim, 0.5), (args.qk_rope_head_dim, 1.0)),
            "wkv_b": ((args.qk_nope_head_dim, 0.5), (args.v_head_dim, 0.0))}
