"""Qwen 3.5 dense flavors. Torch-free, so configs are checked before launch.

"9B" is transformers' `Qwen3_5TextConfig` defaults (its docstring: "a Qwen3.5-9B style configuration"), with the
released rope_theta of 1e7 (transformers' class default, 1e4, is a placeholder the released config.json
overrides); other released sizes are not listed: their config.json could not be read here (no hub access)."""

from tessera.models.common.qwen3_5_args import FULL, LINEAR, Qwen35Args

# name: dim, layers, heads, kv heads, head_dim, ffn hidden, linear k heads, v heads, k/v head dim
_TABLE = {
    "tiny": (64, 4, 4, 2, 16, 128, 2, 4, 16),  # for tests: milliseconds per step
    "debugmodel": (256, 8, 8, 2, 64, 768, 4, 8, 32),
    "9B": (4096, 32, 16, 4, 256, 12288, 16, 32, 128),
}
# tiny alternates its mixers, so that each of two pipeline stages holds both
_TYPES = {"tiny": [LINEAR, FULL, LINEAR, FULL]}

FLAVORS = {name: Qwen35Args(dim=d, n_layers=n, n_heads=h, n_kv_heads=kv, head_dim=hd, ffn_hidden=f, linear_k_heads=lk,
                            linear_v_heads=lv, linear_k_dim=ld, linear_v_dim=ld, layer_types=_TYPES.get(name, []),
                            rope_theta=1e7)
           for name, (d, n, h, kv, hd, f, lk, lv, ld) in _TABLE.items()}
TAKES_TOKENIZER_VOCAB = {"tiny", "debugmodel"}
