"""The Flux transformer, under diffusers' module names (FluxTransformer2DModel), so its weights load as they are.

Double-stream blocks keep image and text tokens in their own weights and attend jointly ([text, image]);
single-stream blocks run the joint sequence through one fused attention + MLP. Each block is modulated
(adaLN: shift, scale, gate) by one vector per sample: the timestep's sinusoidal embedding (and the guidance
scale's, for guidance-distilled flavors) plus the pooled text embedding. Attention is bidirectional with RoPE over
3 id axes (text, height, width) on interleaved pairs. The attention kernel is a module (`attn.sdpa`), so context
parallelism can swap it.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.flux.args import FluxArgs


def rope(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, head_dim] for ids [S, axes], each axis' frequencies over its own dims, every one repeated
    for the pair it rotates. In float64, as diffusers computes them, then float32."""
    cos, sin = [], []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles = torch.outer(ids[:, axis].to(torch.float64), freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1))
        sin.append(angles.sin().repeat_interleave(2, dim=1))
    return torch.cat(cos, dim=-1).float(), torch.cat(sin, dim=-1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, h, s, d]: each pair (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), in float32."""
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [b, dim] of t (already scaled by 1000), cosines first."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t[:, None].float() * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class Attend(nn.Module):
    """Bidirectional attention over every key it is given; context parallelism replaces it with one that
    gathers the keys and values of the other ranks' tokens first."""

    bidirectional = True

    @staticmethod
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    def forward(self, q, k, v):
        return self.attend(q, k, v)


class MLPEmbedder(nn.Module):
    def __init__(self, d_in: int, dim: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(d_in, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    def __init__(self, args: FluxArgs):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, args.dim)
        self.guidance_embedder = MLPEmbedder(256, args.dim) if args.guidance_embed else None
        self.text_embedder = MLPEmbedder(args.pooled_dim, args.dim)

    def forward(self, t, pooled, guidance=None):
        dtype = pooled.dtype
        vec = self.timestep_embedder(timestep_embedding(t * 1000).to(dtype)) + self.text_embedder(pooled)
        if self.guidance_embedder is not None:
            vec = vec + self.guidance_embedder(timestep_embedding(guidance * 1000).to(dtype))
        return vec


class Modulation(nn.Module):
    """adaLN: n vectors (shift, scale, gate, ...) per sample from the conditioning vector."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.linear, self.n = nn.Linear(dim, n * dim), n

    def forward(self, vec):
        return self.linear(F.silu(vec)).chunk(self.n, dim=1)


def modulate(x, shift, scale):
    return F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


class GeluProj(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, hidden), nn.Identity(), nn.Linear(hidden, dim)])

    def forward(self, x):
        return self.net[2](self.net[0](x))


class Attention(nn.Module):
    """q, k, v with per-head RMS norms; the double blocks' also hold the text stream's (add_*, *_added_*)."""

    def __init__(self, args: FluxArgs, joint: bool):
        super().__init__()
        d, hd = args.dim, args.head_dim
        self.head_dim = hd
        self.to_q, self.to_k, self.to_v = (nn.Linear(d, d) for _ in range(3))
        self.norm_q, self.norm_k = nn.RMSNorm(hd, eps=1e-6), nn.RMSNorm(hd, eps=1e-6)
        if joint:
            self.to_out = nn.ModuleList([nn.Linear(d, d)])
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(d, d) for _ in range(3))
            self.norm_added_q, self.norm_added_k = nn.RMSNorm(hd, eps=1e-6), nn.RMSNorm(hd, eps=1e-6)
            self.to_add_out = nn.Linear(d, d)
        self.sdpa = Attend()

    def _heads(self, x, proj, norm=None):
        x = proj(x).unflatten(-1, (-1, self.head_dim))
        return (norm(x) if norm is not None else x).transpose(1, 2)  # [b, h, s, hd]

    def qkv(self, x, q, k, v, nq, nk):
        return self._heads(x, q, nq), self._heads(x, k, nk), self._heads(x, v)

    def forward(self, x, rope_cs, txt=None):
        """x: the image (or joint) stream; txt: the text stream of a double block, attended with x as [txt, x]."""
        q, k, v = self.qkv(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
        if txt is not None:
            tq, tk, tv = self.qkv(txt, self.add_q_proj, self.add_k_proj, self.add_v_proj, self.norm_added_q,
                                  self.norm_added_k)
            q, k, v = torch.cat([tq, q], dim=2), torch.cat([tk, k], dim=2), torch.cat([tv, v], dim=2)
        cos, sin = rope_cs
        out = self.sdpa(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v).transpose(1, 2).flatten(2)
        if txt is None:
            return out
        n_txt = txt.shape[1]
        return self.to_out[0](out[:, n_txt:]), self.to_add_out(out[:, :n_txt])


class DoubleBlock(nn.Module):
    def __init__(self, args: FluxArgs):
        super().__init__()
        self.norm1, self.norm1_context = Modulation(args.dim, 6), Modulation(args.dim, 6)
        self.attn = Attention(args, joint=True)
        self.ff, self.ff_context = FeedForward(args.dim, args.mlp_hidden), FeedForward(args.dim, args.mlp_hidden)

    def forward(self, img, txt, vec, rope_cs):
        i_shift, i_scale, i_gate, i_shift2, i_scale2, i_gate2 = self.norm1(vec)
        t_shift, t_scale, t_gate, t_shift2, t_scale2, t_gate2 = self.norm1_context(vec)
        img_attn, txt_attn = self.attn(modulate(img, i_shift, i_scale), rope_cs, modulate(txt, t_shift, t_scale))
        img = img + i_gate[:, None] * img_attn
        img = img + i_gate2[:, None] * self.ff(modulate(img, i_shift2, i_scale2))
        txt = txt + t_gate[:, None] * txt_attn
        txt = txt + t_gate2[:, None] * self.ff_context(modulate(txt, t_shift2, t_scale2))
        return img, txt


class SingleBlock(nn.Module):
    def __init__(self, args: FluxArgs):
        super().__init__()
        self.norm = Modulation(args.dim, 3)
        self.attn = Attention(args, joint=False)
        self.proj_mlp = nn.Linear(args.dim, args.mlp_hidden)
        self.proj_out = nn.Linear(args.dim + args.mlp_hidden, args.dim)

    def forward(self, x, vec, rope_cs):
        shift, scale, gate = self.norm(vec)
        h = modulate(x, shift, scale)
        mlp = F.gelu(self.proj_mlp(h), approximate="tanh")
        return x + gate[:, None] * self.proj_out(torch.cat([self.attn(h, rope_cs), mlp], dim=2))


class FinalNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x, vec):
        scale, shift = self.linear(F.silu(vec)).chunk(2, dim=1)  # diffusers' AdaLayerNormContinuous: scale first
        return modulate(x, shift, scale)


class Flux(nn.Module):
    def __init__(self, args: FluxArgs):
        super().__init__()
        self.args = args
        self.x_embedder = nn.Linear(args.in_channels, args.dim)
        self.context_embedder = nn.Linear(args.context_dim, args.dim)
        self.time_text_embed = TimeTextEmbed(args)
        self.transformer_blocks = nn.ModuleDict({str(i): DoubleBlock(args) for i in range(args.n_double)})
        self.single_transformer_blocks = nn.ModuleDict({str(i): SingleBlock(args) for i in range(args.n_single)})
        self.norm_out = FinalNorm(args.dim)
        self.proj_out = nn.Linear(args.dim, args.in_channels)

    def init_buffers(self, device, positions=None) -> None:
        """No buffers: RoPE follows the ids each batch brings (under CP, this rank's tokens' own)."""

    def param_init(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        if name.endswith("bias"):
            full.zero_()
        elif "norm_q" in name or "norm_k" in name or "norm_added" in name:
            full.fill_(1.0)
        else:
            nn.init.trunc_normal_(full, std=0.02, a=-0.04, b=0.04, generator=gen)

    def forward(self, img, txt, pooled, t, img_ids, txt_ids, guidance=None) -> torch.Tensor:
        """The velocity [b, n, in_channels] of patchified latents `img` [b, n, in_channels] at times `t` [b] in
        [0, 1], given text features `txt` [b, m, context_dim] and `pooled` [b, pooled_dim]; ids [n, 3], [m, 3]."""
        vec = self.time_text_embed(t, pooled, guidance)
        img, txt = self.x_embedder(img), self.context_embedder(txt)
        rope_cs = rope(torch.cat([txt_ids, img_ids]), self.args.axes_dim, self.args.theta)
        for block in self.transformer_blocks.values():
            img, txt = block(img, txt, vec, rope_cs)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_transformer_blocks.values():
            x = block(x, vec, rope_cs)
        return self.proj_out(self.norm_out(x[:, txt.shape[1]:], vec))
