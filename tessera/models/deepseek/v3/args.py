"""DeepSeek V2/V3 hyper-parameters (published configs): multi-head latent attention and DeepSeek MoE. Torch-free,
so configs are checked before launch."""

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
    def moe(self) -> MoEArgs:
        return MoEArgs(n_experts=self.n_experts, top_k=self.top_k, hidden=self.moe_hidden, n_shared=self.n_shared,
                       score_func=self.score_func, route_norm=self.norm_topk_prob, route_scale=self.route_scale,
                       n_groups=self.n_groups, top_groups=self.top_groups,  # MTP depths: blocks L, L + 1...
                       layers=sparse_layers(self.n_layers + self.n_mtp, dense=range(self.first_k_dense)))

    def arch(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}


# name: dim, layers, heads, q rank, kv rank, nope/rope/v head dims, dense hidden, expert hidden, experts, shared,
# top-k, score, groups, top groups, route scale, dense first blocks, vocab, MTP depths
_TABLE = {
    "debugmodel": (64, 3, 4, 32, 32, 16, 8, 16, 192, 32, 8, 1, 2, "sigmoid", 2, 1, 1.0, 1, 0, 0),  # tests, CPU runs
    "debugmodel_v2": (64, 3, 4, 0, 32, 16, 8, 16, 192, 32, 8, 1, 2, "softmax", 1, 1, 1.0, 1, 0, 0),  # plain query
    "debugmodel_mtp": (64, 2, 4, 32, 32, 16, 8, 16, 192, 32, 8, 1, 2, "sigmoid", 2, 1, 1.0, 1, 0, 2),
    "16B": (2048, 27, 16, 0, 512, 128, 64, 128, 10944, 1408, 64, 2, 6, "softmax", 1, 1, 1.0, 1, 102400, 0),
    "236B": (5120, 60, 128, 1536, 512, 128, 64, 128, 12288, 1536, 160, 2, 6, "softmax", 8, 3, 16.0, 1, 102400, 0),
    "671B": (7168, 61, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 1, 8, "sigmoid", 8, 4, 2.5, 3, 129280, 1),
    # Kimi K2 (moonshotai/Kimi-K2-Base's config.json; K2.5's text model the same): DeepSeek V3 with half the heads,
    # 384 experts, routing without groups, one dense block, RoPE base 50000 (its YaRN extension left to the run)
    "kimi_k2": (7168, 61, 64, 1536, 512, 128, 64, 128, 18432, 2048, 384, 1, 8, "sigmoid", 1, 1, 2.827, 1, 163840, 0),
    "v32_debugmodel": (64, 3, 4, 32, 32, 16, 8, 16, 192, 32, 8, 1, 2, "sigmoid", 2, 1, 1.0, 1, 0, 0),
    "v32_671B": (7168, 61, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 1, 8, "sigmoid", 8, 4, 2.5, 3, 129280, 1),
    # GLM-5 (transformers' GlmMoeDsaConfig defaults, its checkpoint zai-org/GLM-5: 744B, 40B active): DSA with the
    # indexer's RoPE in pairs; its debug model shares one block's selection with the next
    "glm5_debugmodel": (64, 4, 4, 32, 32, 16, 8, 16, 192, 32, 8, 1, 2, "sigmoid", 1, 1, 2.5, 1, 0, 0),
    "glm5": (6144, 78, 64, 2048, 512, 192, 64, 256, 12288, 2048, 256, 1, 8, "sigmoid", 1, 1, 2.5, 3, 154880, 0),
}
_ROPE_THETA = {"kimi_k2": 50000.0}
# DeepSeek V3.2 (DSA): V3's sizes with the indexer (index_topk, heads, head dim); V3.2-Exp's config.json
_INDEXER = {"v32_debugmodel": (16, 4, 16), "v32_671B": (2048, 64, 128), "glm5_debugmodel": (16, 4, 16),
            "glm5": (2048, 32, 128)}
_GLM = {"glm5_debugmodel": [2], "glm5": []}  # GLM-5 flavors: their blocks sharing an earlier block's selection


def _indexer(name: str) -> dict:
    if name not in _INDEXER:
        return {}
    glm = {"index_rope_interleave": True, "index_shared": _GLM[name], "norm_eps": 1e-5} if name in _GLM else {}
    return {**dict(zip(("index_topk", "index_n_heads", "index_head_dim"), _INDEXER[name], strict=True)), **glm}


FLAVORS = {name: DeepSeekV3Args(dim=d, n_layers=n, n_heads=h, q_lora_rank=qr, kv_lora_rank=kr, qk_nope_head_dim=nope,
                                qk_rope_head_dim=rope, v_head_dim=v, ffn_hidden=f, moe_hidden=mh, n_experts=e,
                                n_shared=s, top_k=k, score_func=sf, n_groups=g, top_groups=tg, route_scale=rs,
                                first_k_dense=fk, vocab_size=vocab,
                                rope_interleave=name in ("671B", "kimi_k2", "debugmodel", *_INDEXER),
                                rope_theta=_ROPE_THETA.get(name, 10000.0), n_mtp=mtp,
                                **_indexer(name))
           for name, (d, n, h, qr, kr, nope, rope, v, f, mh, e, s, k, sf, g, tg, rs, fk, vocab, mtp) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"debugmodel", "debugmodel_v2", "debugmodel_mtp", "v32_debugmodel", "glm5_debugmodel"}
