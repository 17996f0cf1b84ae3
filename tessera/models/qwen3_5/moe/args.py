"""Qwen 3.5 MoE hyper-parameters and flavors: Qwen 3.5's hybrid blocks, each with a mixture of experts and a
gated shared expert. Torch-free.

The released sizes as TorchTitan's qwen3_5 flavors state them (torchtitan/models/qwen3_5/flavors.py, which loads
the released weights), rope_theta 1e7 in all (the class default, 1e4, is a placeholder the released config.json
overrides). "35B-A3B" is also transformers' `Qwen3_5MoeTextConfig` defaults (its docstring's checkpoint,
Qwen/Qwen3.5-35B-A3B); slime's Megatron scripts (THUDM/slime scripts/models) give the same attention, experts and
rope_theta for 35B-A3B and 397B-A17B."""

from tessera.models.qwen3_5.args import FULL, LINEAR, Qwen35MoeArgs

# name: dim, layers, heads, kv heads, head_dim, linear k heads, v heads, k/v head dim, experts, top-k, expert and
# shared hidden
_TABLE = {
    "debugmodel_moe": (64, 4, 4, 2, 16, 2, 4, 16, 8, 2, 32),  # for tests and CPU runs
    "35B-A3B": (2048, 40, 16, 2, 256, 16, 32, 128, 256, 8, 512),
    "122B-A10B": (3072, 48, 32, 2, 256, 16, 64, 128, 256, 8, 1024),
    "397B-A17B": (4096, 60, 32, 2, 256, 16, 64, 128, 512, 10, 1024),
}
_TYPES = {"debugmodel_moe": [LINEAR, FULL, LINEAR, FULL]}  # each of two pipeline stages holds both mixers
FLAVORS = {name: Qwen35MoeArgs(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, linear_k_heads=lk,
                               linear_v_heads=lv, linear_k_dim=ld, linear_v_dim=ld, n_experts=e, top_k=k,
                               moe_hidden=mh, shared_hidden=mh, layer_types=_TYPES.get(name, []), rope_theta=1e7,
                               ffn_hidden=0)
           for name, (d, n, h, kv, hd, lk, lv, ld, e, k, mh) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"debugmodel_moe"}
