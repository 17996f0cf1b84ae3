"""Llama 3 decoder. Plain PyTorch: no parallelism here; plans in parallelize.py shard it from outside.

Weights follow the Hugging Face layout (RoPE rotates halves, not interleaved pairs), so HF checkpoints
load without permuting q/k.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.llama3.args import Llama3Args


def rope_inv_freq(args: Llama3Args) -> torch.Tensor:
    """Inverse frequencies, with Llama 3.1's scaling: long wavelengths slowed by `factor`, a smooth ramp between."""
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
    if not args.rope_scaling_factor:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low, high = args.rope_original_max_pos / args.rope_low_freq_factor, args.rope_original_max_pos / args.rope_high_freq_factor
    smooth = (args.rope_original_max_pos / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor)
    scaled = torch.where(wavelen > low, inv_freq / args.rope_scaling_factor, inv_freq)
    ramp = (1 - smooth) * scaled / args.rope_scaling_factor + smooth * scaled
    return torch.where((wavelen >= high) & (wavelen <= low), ramp, scaled)


def rope_cache(args: Llama3Args, device=None) -> torch.Tensor:
    """[max_seq_len, 2, head_dim]: cos and sin for every position."""
    pos = torch.arange(args.max_seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(pos, rope_inv_freq(args).to(device))
    angles = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; rope: [seq, 2, head_dim]."""
    cos, sin = rope[:, 0].unsqueeze(1).to(x.dtype), rope[:, 1].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSDPA(nn.Module):
    """The attention kernel, a module of its own so a parallelism (context parallel) can swap it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.sdpa = CausalSDPA()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """rope: the table for all positions, [max_seq_len, 2, head_dim]."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope[:seq]), apply_rope(k, rope[:seq])
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer id keeps parameter names stable when a pipeline stage drops layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied: the embedding matrix is used directly, since module-level sharing does not survive to_empty().
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_cache(args, device="meta"), persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        self.rope = rope_cache(self.args, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [batch, seq] -> logits [batch, seq, vocab].

        A pipeline stage lacks the modules of other stages (None): it takes and returns hidden states.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            # The whole table: attention slices it once it sees the whole sequence (under sequence
            # parallelism the residual stream between blocks holds only a slice of it).
            h = layer(h, self.rope)
        if self.norm is None:
            return h
        h = self.norm(h)
        return F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)

    def param_init(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` in place.

        Embeddings N(0, 1); q/k/v/w1 truncated N(0, 0.02); the projections that write into the residual
        stream (wo, w2, w3) shrink with depth, 0.02 / sqrt(2 (layer + 1)), so early updates stay small;
        output N(0, dim^-1/2) truncated at 3 sigma; norms 1.
        """
        if name.endswith("norm.weight"):
            full.fill_(1.0)
        elif name == "tok_embeddings.weight":
            full.normal_(0.0, 1.0, generator=gen)
        elif name == "output.weight":
            std = self.args.dim ** -0.5
            nn.init.trunc_normal_(full, 0.0, std, -3 * std, 3 * std, generator=gen)
        else:
            depth_scaled = name.endswith(("wo.weight", "w2.weight", "w3.weight"))
            std = 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1)) if depth_scaled else 0.02
            nn.init.trunc_normal_(full, 0.0, std, -2 * std, 2 * std, generator=gen)

