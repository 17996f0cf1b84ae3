"""Qwen 3.5 dense flavors. Torch-free, so configs are checked before launch.

The released sizes as TorchTitan's qwen3_5 flavors state them (torchtitan/models/qwen3_5/flavors.py, which loads
the released weights), rope_theta 1e7 in all (transformers' class default, 1e4, is a placeholder the released
config.json overrides). "9B" is also transformers' `Qwen3_5TextConfig` defaults (its example: "the Qwen3.5-9B style
configuration"); slime's Megatron scripts (THUDM/slime scripts/models) give the same attention, FFN, tying and
rope_theta for 0.8B and 27B. The three smallest tie the embedding and the output."""

from tessera.models.qwen3_5.args import FULL, LINEAR, Qwen35Args

# name: dim, layers, heads, kv heads, head_dim, ffn hidden, linear k heads, v heads, k/v head dim
_TABLE = {
    "tiny": (64, 4, 4, 2, 16, 128, 2, 4, 16),  # for tests: milliseconds per step
    "debugmodel": (256, 8, 8, 2, 64, 768, 4, 8, 32),
    "0.8B": (1024, 24, 8, 2, 256, 3584, 16, 16, 128),
    "2B": (2048, 24, 8, 2, 256, 6144, 16, 16, 128),
    "4B": (2560, 32, 16, 4, 256, 9216, 16, 32, 128),
    "9B": (4096, 32, 16, 4, 256, 12288, 16, 32, 128),
    "27B": (5120, 64, 24, 4, 256, 17408, 16, 48, 128),
}
_TIED = {"0.8B", "2B", "4B"}
# tiny alternates its mixers, so that each of two pipeline stages holds both
_TYPES = {"tiny": [LINEAR, FULL, LINEAR, FULL]}

FLAVORS = {name: Qwen35Args(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, ffn_hidden=f, linear_k_heads=lk,
                            linear_v_heads=lv, linear_k_dim=ld, linear_v_dim=ld, layer_types=_TYPES.get(name, []),
                            rope_theta=1e7, tie_embeddings=name in _TIED)
           for name, (d, n, h, kv, hd, f, lk, lv, ld) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"tiny", "debugmodel"}
