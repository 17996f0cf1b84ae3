"""Kimi Linear's own options (the [kimi_linear] section): how its KDA layers compute
(tessera.models.common.linear_options), and its checks."""

from tessera.models.common import linear_options
from tessera.models.common.linear_options import LinearAttentionOptions as KimiLinearOptions

__all__ = ["KimiLinearOptions", "check"]


def check(cfg, args, dims) -> None:
    linear_options.check(cfg, dims, "kimi_linear", args.conv_kernel, args.linear_heads, "KDA")
