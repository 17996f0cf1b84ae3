"""DeepSeek V2/V3 (and V3.2, GLM-5, Kimi K2) flavors: the group's args (tessera/models/deepseek/args.py) of their
published configs. Torch-free."""

from tessera.models.deepseek.args import DeepSeekV3Args

__all__ = ["FLAVORS", "TAKES_TOKENIZER_VOCAB", "DeepSeekV3Args"]

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
