"""DeepSeek V4 hyper-parameters and flavors. Torch-free, so configs are checked before launch.

Every block attends by a sliding window over its single shared key/value head (keys are values), with a learned
sink per head; a compressed sparse attention (CSA) block adds entries that compress `csa_rate` tokens each (two
overlapping series), of which a lightning indexer picks `index_topk` per query; a heavily compressed (HCA) block
adds entries of `hca_rate` tokens each, all visible. The residual stream is `hc_mult` streams mixed by
manifold-constrained hyper-connections. Every block's FFN is DeepSeek MoE; the first blocks route by a fixed
table of token ids (hash routing).

"Flash" and "Pro" are deepseek-ai/DeepSeek-V4-Flash's and -Pro's released configs (transformers' DeepseekV4Config
defaults are Flash's)."""

import dataclasses
from dataclasses import dataclass, field

from tessera.models.common.moe_args import MoEArgs

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH, TOPK = "hash_moe", "moe"


def default_layer_types(n_layers: int) -> list[str]:
    """transformers' default: two HCA blocks, then CSA and HCA in turn."""
    return [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]


@dataclass
class DeepSeekV4Args:
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512  # queries' and the shared key/value head's
    rope_head_dim: int = 64  # the trailing dims of each head that RoPE turns (in pairs)
    q_lora_rank: int = 1024  # the query's low-rank bottleneck (the indexer's queries start from it too)
    o_groups: int = 8  # the grouped output projection: heads in o_groups groups, each projected to o_lora_rank
    o_lora_rank: int = 1024
    window: int = 128  # keys a query sees uncompressed: itself and the window - 1 before it
    layer_types: list[str] = field(default_factory=list)  # per block: SLIDING, CSA or HCA; empty: transformers'
    # default (default_layer_types)
    csa_rate: int = 4  # tokens per compressed entry of CSA blocks
    hca_rate: int = 128  # ... of HCA blocks
    index_n_heads: int = 64  # CSA's lightning indexer: its heads
    index_head_dim: int = 128  # their size
    index_topk: int = 512  # the compressed entries each query attends
    hc_mult: int = 4  # residual streams (mHC)
    hc_sinkhorn_iters: int = 20  # Sinkhorn-Knopp iterations making the streams' mixing doubly stochastic
    hc_eps: float = 1e-6
    moe_hidden: int = 2048
    n_experts: int = 256
    n_shared: int = 1
    top_k: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    norm_topk_prob: bool = True
    mlp_layer_types: list[str] = field(default_factory=list)  # per block: HASH or TOPK routing; empty: 3 HASH first
    swiglu_limit: float = 10.0  # the experts' (and shared experts') SwiGLU inputs clamped
    vocab_size: int = 129280  # debugmodel takes the tokenizer's instead
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # sliding blocks' RoPE
    compress_rope_theta: float = 160000.0  # compressed blocks', their compressors' and indexer's
    rope_scaling: dict | None = None  # YaRN of the compressed blocks' RoPE (transformers' rope_parameters)
    max_seq_len: int = 4096  # length of the RoPE tables; set from training.seq_len
    tie_embeddings: bool = False
    n_mtp: int = 0  # multi-token prediction depths (the release's `mtp.*`: one)
    mtp_layer_types: list[str] = field(default_factory=list)  # each depth's block's attention, as layer_types
    # (the first n_mtp); empty: sliding (the releases' compress_ratios end in 0 for it)

    def __post_init__(self):
        self.layer_types = list(self.layer_types) or default_layer_types(self.n_layers)
        self.mlp_layer_types = list(self.mlp_layer_types) or [HASH if i < 3 else TOPK for i in range(self.n_layers)]
        self.mtp_layer_types = list(self.mtp_layer_types)[:self.n_mtp] or [SLIDING] * self.n_mtp  # fewer depths
        # (n_mtp replaced by a smaller number) keep their first ones' kinds
        for name, kinds, n in (("layer_types", (SLIDING, CSA, HCA), self.n_layers),
                               ("mlp_layer_types", (HASH, TOPK), self.n_layers),
                               ("mtp_layer_types", (SLIDING, CSA, HCA), self.n_mtp)):
            value = getattr(self, name)
            if len(value) != n or set(value) - set(kinds):
                raise ValueError(f"{name} = {value!r}: one of {', '.join(kinds)} per block ({n})")

    def with_depths(self) -> "DeepSeekV4Args":
        """The trunk extended by the MTP depths' blocks (block n_layers + k is depth k's; routed by score, as the
        release's depth is), which the depths build their blocks from."""
        return dataclasses.replace(self, n_layers=self.n_layers + self.n_mtp, n_mtp=0, mtp_layer_types=[],
                                   layer_types=self.layer_types + self.mtp_layer_types,
                                   mlp_layer_types=self.mlp_layer_types + [TOPK] * self.n_mtp)

    def rate(self, layer_id: int) -> int:
        """Tokens per compressed entry of block `layer_id`; 0: a sliding block."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer_id]]

    def hashed(self, layer_id: int) -> bool:
        return self.mlp_layer_types[layer_id] == HASH

    @property
    def moe(self) -> MoEArgs:
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden, n_shared=self.n_shared,
                       score_func=self.score_func, route_norm=self.norm_topk_prob, route_scale=self.route_scale,
                       swiglu_limit=self.swiglu_limit, swiglu_alpha=1.0, swiglu_up_shift=0.0, clamp_shared=True)

    def block_moe(self, layer_id: int) -> MoEArgs:
        return dataclasses.replace(self.moe, hash_vocab=self.vocab_size if self.hashed(layer_id) else 0,
                                   hash_seed=layer_id)

    # what the shared decoder and the estimate read
    n_kv_heads = 1
    qk_norm = False
    attention_bias = False
    ffn_hidden = 0  # no dense block

    @property
    def rope_dim(self) -> int:
        return self.rope_head_dim

    takes_ulysses = False  # the compressed entries span the sequence, which Ulysses' head split cannot share out

    def cp_gathered(self, tp: int) -> float:
        """Elements per token a block gathers under all-gather CP, on average over blocks
        (tessera.estimate.cost.cp_bytes): a compressed block's entries (one key/value head per `rate` tokens) and a
        CSA block's indexer keys per entry; each chunk's window tail, `window` keys once a chunk, is left out."""
        per_block = [(self.head_dim + (self.index_head_dim if kind == CSA else 0)) / self.rate(i)
                     for i, kind in enumerate(self.layer_types) if kind != SLIDING]
        return sum(per_block) / self.n_layers

    def arch(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}


def _types(n_layers: int, first: list[str]) -> list[str]:
    """`first`, then CSA and HCA in turn."""
    return first + [CSA if i % 2 == 0 else HCA for i in range(n_layers - len(first))]


_YARN = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
         "beta_slow": 1, "attention_factor": 1.0}
# for tests and CPU runs: one block of each attention, a hash-routed block first; compressed entries of 4 and 8 tokens,
# a window of 8
_DEBUG = DeepSeekV4Args(dim=64, n_layers=4, n_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2,
                        o_lora_rank=16, window=8, layer_types=[SLIDING, CSA, HCA, CSA], csa_rate=4, hca_rate=8,
                        index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2, hc_sinkhorn_iters=5,
                        moe_hidden=32, n_experts=8, top_k=2, mlp_layer_types=[HASH, TOPK, TOPK, TOPK], vocab_size=0)
FLAVORS = {
    "debugmodel": _DEBUG,
    # with two MTP depths (the first a CSA block, the second sliding)
    "debugmodel_mtp": dataclasses.replace(_DEBUG, n_mtp=2, mtp_layer_types=[CSA, SLIDING]),
    # deepseek-ai/DeepSeek-V4-Flash: 284B parameters, 13B active; its one MTP depth beside them
    "Flash": DeepSeekV4Args(rope_scaling=_YARN, max_seq_len=4096,
                            layer_types=_types(43, [SLIDING, SLIDING]), n_mtp=1),
    # deepseek-ai/DeepSeek-V4-Pro: 1.6T parameters, 49B active
    "Pro": DeepSeekV4Args(dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, n_experts=384,
                          moe_hidden=3072, rope_scaling=_YARN, layer_types=_types(61, [HCA, HCA]), n_mtp=1),
}
TAKES_TOKENIZER_VOCAB = {"debugmodel", "debugmodel_mtp"}
