"""Flux (text-to-image rectified-flow transformer) hyper-parameters. Torch-free, so configs are checked before launch.

The published sizes (black-forest-labs/FLUX.1-schnell and FLUX.1-dev, transformer/config.json): 19 double-stream
and 38 single-stream blocks, 24 heads of 128 (hidden 3072), MLP ratio 4, 64 input channels (16 latent channels in
2x2 patches), T5-XXL sequence features of 4096, CLIP-L pooled features of 768, RoPE axes (16, 56, 56) over (text,
height, width) ids with theta 10000. dev also embeds the guidance scale (guidance distillation); schnell does not.
"""

import dataclasses
from dataclasses import dataclass


@dataclass
class FluxArgs:
    n_heads: int = 24
    head_dim: int = 128
    n_double: int = 19  # double-stream blocks: image and text with their own weights, joint attention
    n_single: int = 38  # single-stream blocks over the joint sequence
    in_channels: int = 64  # latent channels x patch x patch
    context_dim: int = 4096  # the text encoder's sequence features (T5)
    pooled_dim: int = 768  # the pooled text embedding (CLIP)
    mlp_ratio: float = 4.0
    axes_dim: tuple[int, int, int] = (16, 56, 56)  # RoPE dims per id axis (text, height, width); sums to head_dim
    theta: int = 10000
    guidance_embed: bool = False
    vocab_size: int = 0  # no vocabulary: the contract's field, unused
    max_seq_len: int = 4608  # text + image tokens; set from training.seq_len

    def __post_init__(self):
        self.axes_dim = tuple(self.axes_dim)  # a list when read back from model.json

    @property
    def dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @property
    def n_layers(self) -> int:
        return self.n_double + self.n_single

    def arch(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "max_seq_len"}


# name: heads, head_dim, double, single, in channels, context, pooled, axes, guidance
_TABLE = {
    # Tests and the CPU debug run: 3 latent channels (the debug autoencoder's) in 2x2 patches, tiny encoders
    "flux-debug": (8, 16, 2, 2, 12, 32, 32, (4, 6, 6), False),
    "flux-schnell": (24, 128, 19, 38, 64, 4096, 768, (16, 56, 56), False),
    "flux-dev": (24, 128, 19, 38, 64, 4096, 768, (16, 56, 56), True),
}
FLAVORS = {name: FluxArgs(n_heads=h, head_dim=hd, n_double=nd, n_single=ns, in_channels=c, context_dim=ctx,
                          pooled_dim=p, axes_dim=axes, guidance_embed=g)
           for name, (h, hd, nd, ns, c, ctx, p, axes, g) in _TABLE.items()}
