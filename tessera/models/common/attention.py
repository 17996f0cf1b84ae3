"""Causal self-attention with grouped (GQA) or multi-query (MQA) key/value heads, optional biases, optional
per-head RMSNorm of queries and keys before RoPE (Qwen 3), masks narrower than causal (a sliding window, or
chunks attended within), learned attention sinks, and a key/value cache for incremental decoding."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.common.rope import apply_rope


def allowed(n_q: int, n_k: int, window: int = 0, chunk: int = 0, device=None) -> torch.Tensor:
    """[n_q, n_k] bool: which keys each query sees. Queries are the last n_q of the n_k positions; each sees
    the keys at or before it, only the last `window` of them (0: all), and only those of its own `chunk`
    of positions (0: one chunk)."""
    q = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    k = torch.arange(n_k, device=device)[None]
    ok = k <= q
    if window:
        ok &= k > q - window
    if chunk:
        ok &= k // chunk == q // chunk
    return ok


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention where `mask` allows; `sinks` [heads]: a logit per head in every softmax's denominator (it takes
    probability mass and holds no value), computed eagerly. Under TP a rank holds its heads' sinks (a DTensor)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    sinks = sinks.to_local() if isinstance(sinks, DTensor) else sinks
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs @ v


class CausalSDPA(nn.Module):
    """The attention kernel, a module of its own so a parallelism (context parallel) can swap it. Queries are
    the last positions of the keys (all of them in training; the new ones when decoding with a cache).
    `window`/`chunk` narrow the causal mask (see `allowed`); `n_sinks` heads get a learned sink logit each,
    a column every query attends that holds no value (it only takes probability mass), computed eagerly."""

    def __init__(self, window: int = 0, chunk: int = 0, n_sinks: int = 0, scale: float | None = None):
        super().__init__()
        self.window, self.chunk, self.scale = window, chunk, scale  # scale: of the scores, None: head_dim^-1/2
        self.sinks = nn.Parameter(torch.empty(n_sinks)) if n_sinks else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` [batch, n_k]: each position's document number; queries then see only their own."""
        n_q, n_k = q.shape[2], k.shape[2]
        if n_q == n_k and not (self.window or self.chunk or self.sinks is not None or documents is not None):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
        mask = allowed(n_q, n_k, self.window, self.chunk, q.device)
        if documents is not None:  # [batch, 1 (heads), n_q, n_k]
            mask = (mask & (documents[:, -n_q:, None] == documents[:, None, :])).unsqueeze(1)
        return masked_attention(q, k, v, mask, self.scale, self.sinks)

    # For a kernel that replaces this one (context parallel) and keeps its masks and sinks.
    mask, attend = staticmethod(allowed), staticmethod(masked_attention)


class KVCache(nn.Module):
    """One layer's keys and values for positions [0, length), written as decoding goes on; values may have a
    head size of their own (`v_dim`, MLA's)."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device=None,
                 v_dim: int = 0):
        super().__init__()
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(batch, n_kv_heads, max_len, v_dim or head_dim, dtype=dtype,
                                              device=device))
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
                 norm_eps: float = 1e-6, bias: bool = False, window: int = 0, chunk: int = 0, sinks: bool = False):
        super().__init__()
        self.sdpa = CausalSDPA(window, chunk, n_heads if sinks else 0)
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """rope: the table for all positions, [max_seq_len, 2, head_dim]; `cache`: earlier positions' keys
        and values, which x's positions follow; `documents`: see CausalSDPA."""
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
        out = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents)
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
