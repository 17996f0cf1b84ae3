"""Causal self-attention with grouped (GQA) or multi-query (MQA) key/value heads, optional per-head RMSNorm
of queries and keys before RoPE (Qwen 3), and a key/value cache for incremental decoding."""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.common.rope import apply_rope


class CausalSDPA(nn.Module):
    """The attention kernel, a module of its own so a parallelism (context parallel) can swap it. Queries are
    the last positions of the keys (all of them in training; the new ones when decoding with a cache)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_q, n_k = q.shape[2], k.shape[2]
        if n_q == n_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class KVCache(nn.Module):
    """One layer's keys and values for positions [0, length), written as decoding goes on."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros_like(self.k))
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [batch, heads, new, head_dim]; the keys and values of every position so far."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"the KV cache holds {self.k.shape[2]} positions; {end} asked")
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool = False,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.sdpa = CausalSDPA()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """rope: the table for all positions, [max_seq_len, 2, head_dim]; `cache`: earlier positions' keys
        and values, which x's positions follow."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        start = cache.length if cache is not None else 0
        q, k = apply_rope(q, rope[start:start + seq]), apply_rope(k, rope[start:start + seq])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.sdpa(q, k, v)
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
