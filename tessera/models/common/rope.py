"""Rotary position embeddings in the Hugging Face layout (halves rotated, not interleaved pairs), with the
frequency schedules the families use: plain, and Llama 3.1's scaling. Tables are computed in float64."""

import math

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies; `scaling` {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} slows long wavelengths by `factor`, with a smooth ramp between."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not scaling:
        return freqs
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"unknown RoPE scaling {scaling['rope_type']!r}")
    factor, low_ff, high_ff = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    scaled = torch.where(wavelen > original / low_ff, freqs / factor, freqs)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where((wavelen >= original / high_ff) & (wavelen <= original / low_ff), ramp, scaled)


def rope_table(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """[len(positions), 2, head_dim]: cos and sin at each position."""
    angles = torch.outer(positions.to(torch.float64), freqs.to(positions.device))
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; rope: [seq, 2, head_dim]."""
    cos, sin = rope[:, 0].unsqueeze(1).to(x.dtype), rope[:, 1].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
