"""Rotary position embeddings in the Hugging Face layout (halves rotated, not interleaved pairs), with the
frequency schedules the families use: plain, Llama 3.1's scaling, YaRN and dynamic NTK. Tables are computed in
float64."""

import math

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None, length: int = 0) -> torch.Tensor:
    """Inverse frequencies. `scaling` (as transformers' rope_parameters): {"rope_type": "llama3", factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings} slows long wavelengths by `factor`
    with a smooth ramp between; {"rope_type": "yarn", factor, original_max_position_embeddings, beta_fast,
    beta_slow, truncate} interpolates the dimensions that rotate fewer than beta_slow times over the original
    context, keeps those that rotate more than beta_fast, and ramps linearly between; {"rope_type": "dynamic",
    factor, original_max_position_embeddings} raises theta (NTK-aware) for a table of `length` positions beyond
    the original context, as transformers does when a sequence is that long."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "dynamic":
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        theta *= (factor * max(length, original) / original - (factor - 1)) ** (head_dim / (head_dim - 2))
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if kind in ("default", "dynamic"):
        return freqs
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / freqs
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        scaled = torch.where(wavelen > original / low_ff, freqs / factor, freqs)
        ramp = (1 - smooth) * scaled / factor + smooth * scaled
        return torch.where((wavelen >= original / high_ff) & (wavelen <= original / low_ff), ramp, scaled)
    if kind == "yarn":
        def rotations_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = rotations_dim(scaling.get("beta_fast") or 32), rotations_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
        return freqs / factor * ramp + freqs * (1 - ramp)
    raise ValueError(f"unknown RoPE scaling {kind!r}")


def attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (its attention temperature); 1 otherwise."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rope_table(positions: torch.Tensor, freqs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[len(positions), 2, head_dim]: cos and sin at each position, times `scale`."""
    angles = torch.outer(positions.to(torch.float64), freqs.to(positions.device))
    angles = torch.cat([angles, angles], dim=-1)
    return (torch.stack([angles.cos(), angles.sin()], dim=1) * scale).float()


def rope_rows(rope: torch.Tensor, start: int, seq: int) -> torch.Tensor:
    """The rows for `seq` tokens at positions start, start + 1...: a table [positions, rows, head_dim] is sliced;
    rows a model already picked per token, [batch, seq, rows, head_dim], are theirs as they are."""
    return rope[start:start + seq] if rope.dim() == 3 else rope


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; rope: [seq, 2, head_dim] or per token [batch, seq, 2, head_dim]."""
    cos, sin = rope[..., 0, :].unsqueeze(-2).to(x.dtype), rope[..., 1, :].unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Document numbers [batch, n] -> each token's place in its document, from 0 at its first token (the window's
    first token starts one too)."""
    index = torch.arange(documents.shape[1], device=documents.device)
    starts = torch.diff(documents, dim=1, prepend=documents[:, :1] - 1) != 0
    return index - torch.where(starts, index, 0).cummax(1).values
