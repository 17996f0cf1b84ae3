"""Causal self-attention with grouped (GQA) or multi-query (MQA) key/value heads, optional biases, optional
per-head RMSNorm of queries and keys before RoPE (Qwen 3), masks narrower than causal (a sliding window, chunks
attended within, packed documents), learned attention sinks, and a key/value cache for incremental decoding.

Every attention kind computes in one kernel module, `CausalSDPA`: masks, sinks, documents, DeepSeek's selected keys
(DSA) and compressed entries (V4) are its inputs, so what wraps it (context parallel's swap, QK-clip's hook, the
estimate's GPU-like kernel) reaches them all the same way. Two kernels compute the narrower masks with the same
numbers: on CUDA, FlexAttention (blocks the mask rules out are skipped, no [queries, keys] scores are kept, and
sinks are folded in exactly from its log-sum-exp); elsewhere, and for selections and entries, the blockwise kernel
(tessera.models.common.blockwise: an online softmax over blocks of keys, FlexAttention has no backward on CPU)."""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from tessera.models.common import blockwise
from tessera.models.common.rope import apply_rope, document_positions, rope_rows


def allowed(n_q: int, n_k: int, window: int = 0, chunk: int = 0, device=None) -> torch.Tensor:
    """[n_q, n_k] bool: which keys each query sees (blockwise.sees). Queries are the last n_q of the n_k
    positions."""
    return blockwise.sees(torch.arange(n_k - n_q, n_k, device=device)[:, None],
                          torch.arange(n_k, device=device)[None], window, chunk)


def document_chunks(documents: torch.Tensor, chunk: int) -> torch.Tensor:
    """Document numbers [batch, n] -> numbers of each document's chunks of `chunk` positions, counted from its
    first token (the window's first token starts one too): attending within these is attending within the chunks
    of each document as if it were alone."""
    return (document_positions(documents) % chunk == 0).cumsum(1)


@dataclass(frozen=True)
class Entries:
    """Keys beyond the sequence's own, DeepSeek V4's compressed entries: `kv` [batch, n, dim] (keys that are their
    values), entry j compressing tokens [j rate, (j + 1) rate): a query sees it from its last token on, when its first
    token is in the query's document (`documents` [batch, n]); `selected` [batch, queries, top-k]: the entries each
    query reads (CSA's top-k, -1: none), in place of every visible one (HCA)."""
    kv: torch.Tensor
    rate: int
    documents: torch.Tensor | None = None
    selected: torch.Tensor | None = None


def key_sources(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, chunk: int = 0,
                documents: torch.Tensor | None = None, entries: Entries | None = None,
                selected: torch.Tensor | None = None,
                k_first: int = 0) -> tuple[list[blockwise.Keys], int, torch.Tensor | None]:
    """What `attend`'s arguments ask, as the blockwise kernel's key sources: (sources, the first query's position,
    the queries' documents). Queries are the last n_q of the n_k positions, key 0 at position `k_first`;
    `selected` [batch, n_q, top-k]: the keys each reads (DSA's top-k), in place of the mask."""
    n_q, n_k = q.shape[2], k.shape[2]
    if documents is not None and chunk:
        documents, chunk = document_chunks(documents, chunk), 0
    sources = [blockwise.Keys(k, v, first=k_first, window=window, chunk=chunk, documents=documents,
                              selected=selected)]
    if entries is not None:
        kv = entries.kv.unsqueeze(1)
        sources.append(blockwise.Keys(kv, kv, first=entries.rate - 1, stride=entries.rate,
                                      documents=entries.documents, selected=entries.selected))
    return sources, k_first + n_k - n_q, None if documents is None else documents[:, -n_q:]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, chunk: int = 0,
           scale: float | None = None, sinks: torch.Tensor | None = None, documents: torch.Tensor | None = None,
           masks: "DocumentMasks | None" = None, entries: Entries | None = None,
           selected: torch.Tensor | None = None, k_first: int = 0):
    """Queries at the last n_q of the n_k positions attend the keys `allowed` lets them see, only those of their
    own document (`documents` [batch, n_k]: each position's document number; chunks then count from each
    document's start), with `sinks`; or, `selected` given, the keys it names; and `entries` (see Entries). Plain
    causal attention over whole sequences (Ulysses context parallel's) is the fused kernel's; the narrower masks
    FlexAttention's on CUDA; a decoding step (one query), heads wider than 128 (fp32 MLA's 192 ran out of shared
    memory on an H200), selections, entries and other devices the blockwise kernel's (blockwise.py: no [queries x
    keys] tensor). `k_first`: the position of key 0 (keys starting mid-sequence beside entries counted from its
    start: DeepSeek V4 under context parallel). -> the output [batch, heads, n_q, dv]; with a selection, (it, the
    selected keys' probabilities summed over heads [batch, n_q, top-k])."""
    chosen = selected is not None or (entries is not None and entries.selected is not None)
    plain = entries is None and selected is None and not k_first
    if plain and q.shape[2] == k.shape[2] and not (window or chunk or sinks is not None or documents is not None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    if plain and q.is_cuda and q.shape[2] > 1 and max(q.shape[-1], v.shape[-1]) <= 128:  # wider overflow its tiles
        return flex_attend(q, k, v, window, chunk, scale, sinks, documents, masks)
    sources, q_first, q_docs = key_sources(q, k, v, window, chunk, documents, entries, selected, k_first)
    sinks = sinks.to_local() if isinstance(sinks, DTensor) else sinks
    out, _, picked = blockwise.attention(q, sources, q_first, scale or q.shape[-1] ** -0.5, sinks, q_docs, chosen)
    return (out, picked) if chosen else out


def _mask_rule(n_q: int, n_k: int, window: int, chunk: int, documents: torch.Tensor | None):
    """`allowed` (and the documents) as a FlexAttention mask_mod."""
    offset = n_k - n_q
    if documents is not None and chunk:
        documents, chunk = document_chunks(documents, chunk), 0

    def rule(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        ok = blockwise.sees(pos, kv_idx, window, chunk)
        if documents is not None:
            ok = ok & (documents[b, pos] == documents[b, kv_idx])
        return ok
    return rule


# Memoized safely: a pure function of its arguments (no documents, so no tensor is read): the same mask each time.
@functools.lru_cache(maxsize=64)
def _block_mask(n_q: int, n_k: int, window: int, chunk: int, device: torch.device):
    return create_block_mask(_mask_rule(n_q, n_k, window, chunk, None), None, None, n_q, n_k, device=device,
                             _compile=device.type == "cuda")  # compiled, it never holds the [n_q, n_k] mask


class DocumentMasks:
    """The FlexAttention block masks of one documents tensor, by shape, window and chunk. Every layer of a forward
    asks with the same tensor: each mask is made once a forward, by the first layer that needs it, and kept until
    a forward asks with another tensor. A model's kernels share one (share_document_masks)."""

    def __init__(self):
        self.documents: torch.Tensor | None = None  # the tensor itself: held here, its storage is never reused
        self.masks: dict[tuple, object] = {}

    def __call__(self, documents: torch.Tensor, n_q: int, n_k: int, window: int, chunk: int, device: torch.device):
        if self.documents is not documents:
            self.documents, self.masks = documents, {}
        key = (n_q, n_k, window, chunk)
        if key not in self.masks:
            self.masks[key] = _documents_block_mask(documents, n_q, n_k, window, chunk, device)
        return self.masks[key]


def _documents_block_mask(documents: torch.Tensor, n_q: int, n_k: int, window: int, chunk: int,
                          device: torch.device):
    return create_block_mask(_mask_rule(n_q, n_k, window, chunk, documents), documents.shape[0], None, n_q, n_k,
                             device=device, _compile=documents.is_cuda)


@torch.compiler.disable  # built eagerly, then an input of the compiled attention
def block_mask(n_q: int, n_k: int, window: int, chunk: int, device: torch.device,
               documents: torch.Tensor | None = None, masks: DocumentMasks | None = None):
    if documents is None:
        return _block_mask(n_q, n_k, window, chunk, torch.device(device))
    if masks is None:
        return _documents_block_mask(documents, n_q, n_k, window, chunk, device)
    return masks(documents, n_q, n_k, window, chunk, device)


def use_attention(model: nn.Module, attend_fn) -> nn.Module:
    """`model`'s attention kernels (CausalSDPA) compute with `attend_fn`, a function of `attend`'s arguments, in
    place of `attend` (the context-parallel kernels apply_cp makes afterwards take it from them): the estimate's
    GPU-like attention, a benchmark's materialized scores. Only this model's: no other changes."""
    for kernel in model.modules():
        if isinstance(kernel, CausalSDPA):
            kernel.attend = attend_fn
    return model


def share_document_masks(model: nn.Module) -> None:
    """One DocumentMasks for every attention kernel of `model` (its constructor calls this), so a forward makes
    each documents' mask once, not once per layer."""
    masks = DocumentMasks()
    for kernel in model.modules():
        if isinstance(kernel, CausalSDPA):
            kernel.masks = masks


# Memoized safely: a pure function of nothing (made on first use: torch.compile costs seconds at import).
@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def _flex_kernel(device: torch.device):
    """Compiled on CUDA, where it is a fused kernel (inside a compiled block, the block's compile takes it in)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    return _compiled_flex_attention()


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, chunk: int = 0,
                scale: float | None = None, sinks: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, masks: DocumentMasks | None = None) -> torch.Tensor:
    """`attend` by FlexAttention (compiled on CUDA; eager elsewhere, forward only). A sink s joins each
    softmax's denominator: out · e^lse / (e^lse + e^s) = out · sigmoid(lse − s), exact, and differentiable
    through the log-sum-exp."""
    mask = block_mask(q.shape[2], k.shape[2], window, chunk, q.device, documents, masks)
    kernel = _flex_kernel(q.device)
    if sinks is None:
        return kernel(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    out, aux = kernel(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    sinks = sinks.to_local() if isinstance(sinks, DTensor) else sinks
    return out * torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1)).unsqueeze(-1).to(out.dtype)


class CausalSDPA(nn.Module):
    """The attention kernel of every attention kind, a module of its own so that what wraps attention reaches one
    thing: context parallel swaps it, QK-clip hooks it, the estimate gives it a GPU-like function. Queries are the
    last positions of the keys (all of them in training; the new ones when decoding with a cache). `window`/`chunk`
    narrow the causal mask (see `allowed`); `n_sinks` heads get a learned sink logit each, a column every query
    attends that holds no value (it only takes probability mass)."""

    def __init__(self, window: int = 0, chunk: int = 0, n_sinks: int = 0, scale: float | None = None):
        super().__init__()
        self.window, self.chunk, self.scale = window, chunk, scale  # scale: of the scores, None: head_dim^-1/2
        self.sinks = nn.Parameter(torch.empty(n_sinks)) if n_sinks else None
        self.masks = DocumentMasks()  # its own until its model shares one among its kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None,
                entries: Entries | None = None, selected: torch.Tensor | None = None, k_first: int = 0):
        """q [batch, heads, n_q, dk], k and v [batch, kv heads, n_k, dk or dv]; `documents` [batch, n_k]: each
        position's document number, queries then see only their own; `entries`, `selected`, `k_first`: see
        `attend` (a selection returns (out, the selected keys' probabilities summed over this rank's heads))."""
        return self.attend(q, k, v, self.window, self.chunk, self.scale, self.sinks, documents, self.masks,
                           entries=entries, selected=selected, k_first=k_first)

    def max_logits(self, q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor | None = None,
                   entries: Entries | None = None, selected: torch.Tensor | None = None,
                   k_first: int = 0) -> torch.Tensor:
        """[heads]: the largest score q k^T * scale of a key each query head sees (QK-clip's), in fp32."""
        sources, q_first, q_docs = key_sources(q, k, k, self.window, self.chunk, documents, entries, selected,
                                               k_first)
        return blockwise.max_logits(q, sources, q_first, self.scale or q.shape[-1] ** -0.5, q_docs)

    # The function it computes with: a kernel that replaces this one (context parallel) takes it, with the masks
    # and sinks; tessera.estimate gives its traced models one that holds what a GPU holds.
    attend = staticmethod(attend)


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
        """rope: the table for all positions, [max_seq_len, 2, head_dim], or rows per token (see rope_rows);
        `cache`: earlier positions' keys and values, which x's positions follow; `documents`: see CausalSDPA."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        start = cache.length if cache is not None else 0
        rows = rope_rows(rope, start, seq)
        q, k = apply_rope(q, rows), apply_rope(k, rows)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); with `limit`, w1 x clamped at most it and w3 x within +-it (DeepSeek V4)."""

    def __init__(self, dim: int, hidden: int, limit: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2(F.silu(gate) * up)
