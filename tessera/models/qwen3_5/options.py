"""Qwen 3.5's own options (the [qwen3_5], [qwen3_5_moe] and [qwen3_next] sections): how the Gated DeltaNet layers
compute (tessera.models.common.linear_options)."""

from tessera.models.common import linear_options
from tessera.models.common.linear_options import LinearAttentionOptions as Qwen35Options, apply_options, state_passing

__all__ = ["Qwen35Options", "apply_options", "check", "state_passing"]


def check(cfg, args, dims, section: str = "qwen3_5") -> None:
    linear_options.check(cfg, dims, section, args.conv_kernel, args.linear_k_heads, "DeltaNet")
