"""Attention a block of queries against a block of keys at a time, with an online softmax (the flash-attention
algorithm, in torch): no [queries x keys] tensor lives at once, forward or backward. A custom autograd function
keeps each query's output and log-sum-exp and recomputes its scores block by block in backward. It is the torch
path of every attention kind (tessera.models.common.attention.CausalSDPA): CPU runs, CUDA where FlexAttention does
not fit (heads wider than 128), decoding, and all-gather context parallel's chunks.

Keys come in sources (`Keys`), all under one softmax, with a learned sink logit per head:
- read by position: key j stands at position first + j * stride (the sequence's keys: 0, 1; DeepSeek V4's entries
  compressing `rate` tokens: at their last token, rate - 1, rate), and a query at position t sees it when it stands
  at or before t, within t's last `window` positions, in t's `chunk`, and in t's document;
- read by selection: `selected` [batch, queries, top-k] indices of the keys each query reads (-1: none), DSA's top-k
  keys and CSA's top-k entries, gathered a block of queries at a time.

Queries are the last positions of the sequence: query i stands at `q_first + i`. Heads are grouped (GQA, MQA): the
query heads of a key head read it without copies. A block holds about SCORES_PER_BLOCK scores (fp32), so memory
grows with the sequence, not its square."""

from dataclasses import dataclass

import torch

SCORES_PER_BLOCK = 1 << 22  # scores (and gathered key elements) one block computes at once: 16 MiB in fp32
KEY_BLOCK = 512  # keys per block, at most


@dataclass(frozen=True)
class Keys:
    """One source of keys (see the module's docstring). k [batch, kv heads, n, dk], v [batch, kv heads, n, dv] (may
    be k itself: keys that are their values); `documents` [batch, n]: each key's document; `selected` [batch,
    queries, top-k]: the keys each query reads, in place of the rule by position."""
    k: torch.Tensor
    v: torch.Tensor
    first: int = 0
    stride: int = 1
    window: int = 0
    chunk: int = 0
    documents: torch.Tensor | None = None
    selected: torch.Tensor | None = None


def sees(t, s, window: int = 0, chunk: int = 0):
    """Whether a query at position t sees a key at position s (tensors that broadcast, or FlexAttention's indices):
    the key stands at or before it, within its last `window` positions (0: all), in its `chunk` of positions (0: one
    chunk). The one place the rule by position is written."""
    ok = s <= t
    if window:
        ok = ok & (s > t - window)
    if chunk:
        ok = ok & (s // chunk == t // chunk)
    return ok


def rule_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0, chunk: int = 0,
              q_docs: torch.Tensor | None = None, k_docs: torch.Tensor | None = None) -> torch.Tensor:
    """[1 or batch, n_q, n_k] bool: which keys (at `k_pos` [n_k], of documents `k_docs` [batch, n_k]) the queries
    (at `q_pos` [n_q], of `q_docs` [batch, n_q]) see: `sees`, and in their document."""
    ok = sees(q_pos[:, None], k_pos[None], window, chunk).unsqueeze(0)
    if q_docs is not None and k_docs is not None:
        ok = ok & (q_docs[:, :, None] == k_docs[:, None, :])
    return ok


def key_range(n: int, p0: int, p1: int, first: int = 0, stride: int = 1, window: int = 0,
              chunk: int = 0) -> tuple[int, int]:
    """The keys [j0, j1) of n (key j at position first + j * stride) that queries at positions p0..p1 may see by
    position (`sees`): the others are masked out whole."""
    end = min(n, max(0, (p1 - first) // stride + 1))
    start = 0
    if window:
        start = max(start, (p0 - window - first) // stride + 1)
    if chunk:
        start = max(start, -(-((p0 // chunk) * chunk - first) // stride))
    return min(start, end), end


def query_block(batch: int, q_heads: int, n_q: int, sources: list[Keys]) -> int:
    """Queries per block: as many as keep a block's scores (and gathered keys) near SCORES_PER_BLOCK."""
    per_query = 1
    for s in sources:
        if s.selected is None:
            per_query = max(per_query, batch * q_heads * min(s.k.shape[2], KEY_BLOCK))
        else:
            top, kv = s.selected.shape[-1], s.k.shape[1]
            per_query = max(per_query, batch * top * (q_heads + kv * (s.k.shape[-1] + s.v.shape[-1])))
    return max(1, min(n_q, SCORES_PER_BLOCK // per_query))


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, d] at index [b, q, t] (clamped to 0 where < 0) -> [b, h, q, t, d]."""
    b, h, _, d = x.shape
    flat = index.clamp(min=0).reshape(b, 1, -1, 1).expand(b, h, -1, d)
    return x.gather(2, flat).view(b, h, *index.shape[1:], d)


class _Plan:
    """The static part of one call: the query positions, each source's rule (its keys and values left out: autograd
    keeps those as saved tensors, so activation checkpointing governs them), block sizes."""

    def __init__(self, q: torch.Tensor, sources: list[Keys], q_first: int, scale: float, q_block: int,
                 k_block: int):
        self.q_first, self.scale = q_first, scale
        self.rules = [Keys(s.k.new_empty(0), s.v.new_empty(0), s.first, s.stride, s.window, s.chunk, s.documents,
                           s.selected) for s in sources]
        self.same_kv = [s.v is s.k for s in sources]
        self.kv_heads = sources[0].k.shape[1]
        self.groups = q.shape[1] // self.kv_heads
        self.q_block = q_block or query_block(q.shape[0], q.shape[1], q.shape[2], sources)
        self.k_block = k_block or KEY_BLOCK

    def sources(self, kv: list[torch.Tensor]) -> list[Keys]:
        """The sources again, from their keys and values [k0, v0, k1, v1, ...]."""
        return [Keys(kv[2 * i], kv[2 * i] if same else kv[2 * i + 1], r.first, r.stride, r.window, r.chunk,
                     r.documents, r.selected) for i, (r, same) in enumerate(zip(self.rules, self.same_kv, strict=True))]

    def query_blocks(self, n_q: int):
        for i0 in range(0, n_q, self.q_block):
            yield i0, min(i0 + self.q_block, n_q)

    def pieces(self, source: Keys, i0: int, i1: int, q_docs: torch.Tensor | None, device):
        """(j0, j1, mask or None where all allowed) of each key block queries i0..i1 may see; for a source by
        selection, one piece (None, None, mask of the selected)."""
        if source.selected is not None:
            yield None, None, (source.selected[:, i0:i1] >= 0)[:, None, None]
            return
        p0, p1 = self.q_first + i0, self.q_first + i1 - 1
        j0, j1 = key_range(source.k.shape[2], p0, p1, source.first, source.stride, source.window, source.chunk)
        q_pos = torch.arange(p0, p1 + 1, device=device)
        for a in range(j0, j1, self.k_block):
            b = min(a + self.k_block, j1)
            first, last = source.first + a * source.stride, source.first + (b - 1) * source.stride
            whole = last <= p0 and (not source.window or first > p1 - source.window) and (
                not source.chunk or first // source.chunk == last // source.chunk == p0 // source.chunk
                == p1 // source.chunk) and (q_docs is None or source.documents is None)
            if whole:
                yield a, b, None
                continue
            k_pos = source.first + torch.arange(a, b, device=device) * source.stride
            mask = rule_mask(q_pos, k_pos, source.window, source.chunk, q_docs,
                             None if source.documents is None else source.documents[:, a:b])
            yield a, b, mask[:, None, None]


def _keys_of(source: Keys, j0, j1, i0: int, i1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's keys and values: [b, h, n, d] by position, [b, h, q, t, d] by selection."""
    if source.selected is None:
        return source.k[:, :, j0:j1], source.v[:, :, j0:j1]
    index = source.selected[:, i0:i1]
    k = _gather(source.k, index)
    return k, k if source.v is source.k else _gather(source.v, index)


def _scores(qb: torch.Tensor, k: torch.Tensor, scale: float, selected: bool) -> torch.Tensor:
    """qb [b, h, g, q, d] against keys -> fp32 scores [b, h, g, q, keys]."""
    if selected:
        return torch.einsum("bhgqd,bhqtd->bhgqt", qb, k).float() * scale
    return torch.einsum("bhgqd,bhkd->bhgqk", qb, k).float() * scale


def _weigh(p: torch.Tensor, v: torch.Tensor, selected: bool) -> torch.Tensor:
    if selected:
        return torch.einsum("bhgqt,bhqtd->bhgqd", p, v)
    return torch.einsum("bhgqk,bhkd->bhgqd", p, v)


def _forward(plan: _Plan, sources: list[Keys], q: torch.Tensor, sinks: torch.Tensor | None,
             q_docs: torch.Tensor | None, want_picked: bool):
    b, hq, n_q, _ = q.shape
    h, g = plan.kv_heads, plan.groups
    dv = sources[0].v.shape[-1]
    out = q.new_empty(b, hq, n_q, dv)
    lse = q.new_empty(b, h, g, n_q, dtype=torch.float32)
    picked = None
    for i0, i1 in plan.query_blocks(n_q):
        qb = q[:, :, i0:i1].unflatten(1, (h, g))
        docs = None if q_docs is None else q_docs[:, i0:i1]
        m = q.new_full((b, h, g, i1 - i0), float("-inf"), dtype=torch.float32)
        total, acc = torch.zeros_like(m), q.new_zeros(b, h, g, i1 - i0, dv, dtype=torch.float32)
        kept = None  # the selected keys' scores, for their probabilities once the softmax's total is known
        for source in sources:
            chosen = source.selected is not None
            for j0, j1, mask in plan.pieces(source, i0, i1, docs, q.device):
                k, v = _keys_of(source, j0, j1, i0, i1)
                s = _scores(qb, k, plan.scale, chosen)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                if chosen:
                    kept = s
                m, total, acc = _online(m, total, acc, s, v, chosen)
        if sinks is not None:
            sink = sinks.float().view(1, h, g, 1).expand_as(m)
            new = torch.maximum(m, sink)
            total = total * (m - new).exp() + (sink - new).exp()
            acc = acc * (m - new).exp()[..., None]
            m = new
        empty = total == 0  # a query that sees no key (none in the selection): output 0
        out[:, :, i0:i1] = (acc / torch.where(empty, 1, total)[..., None]).flatten(1, 2).to(out.dtype)
        lse[..., i0:i1] = torch.where(empty, float("inf"), m + total.log())
        if want_picked and kept is not None:
            probs = (kept - lse[..., i0:i1, None]).exp().sum((1, 2))  # [b, q, top-k], 0 where not selected
            picked = probs if picked is None else torch.cat([picked, probs], dim=1)
    return out, lse, picked


def _online(m, total, acc, s, v, chosen: bool):
    """One piece's scores into the running max, total and weighted values."""
    new = torch.maximum(m, s.amax(-1))
    safe = torch.where(torch.isinf(new), 0.0, new)  # rows with nothing seen yet
    scale = (m - safe).exp()
    p = (s - safe[..., None]).exp()
    total = total * scale + p.sum(-1)
    acc = acc * scale[..., None] + _weigh(p.to(v.dtype), v, chosen).float()
    return new, total, acc


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, want_picked: bool, q: torch.Tensor, sinks: torch.Tensor | None,
                q_docs: torch.Tensor | None, *kv: torch.Tensor):
        out, lse, picked = _forward(plan, plan.sources(list(kv)), q, sinks, q_docs, want_picked)
        ctx.plan = plan
        ctx.save_for_backward(q, sinks, q_docs, out, lse, *kv)
        ctx.mark_non_differentiable(lse)
        if picked is not None:
            ctx.mark_non_differentiable(picked)
        return out, lse, picked

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, _lse, _picked):
        q, sinks, q_docs, out, lse, *kv = ctx.saved_tensors
        plan = ctx.plan
        dq, d_sinks, dkv = _backward(plan, plan.sources(kv), q, sinks, q_docs, out, lse, d_out)
        return (None, None, dq, d_sinks, None, *dkv)


def _backward(plan: _Plan, sources: list[Keys], q, sinks, q_docs, out, lse, d_out):
    b, hq, n_q, _ = q.shape
    h, g = plan.kv_heads, plan.groups
    dq = torch.zeros_like(q, dtype=torch.float32)
    grads = [[torch.zeros_like(s.k, dtype=torch.float32), torch.zeros_like(s.v, dtype=torch.float32)]
             for s in sources]
    d_sinks = None if sinks is None else torch.zeros(h, g, device=q.device, dtype=torch.float32)
    for i0, i1 in plan.query_blocks(n_q):
        qb = q[:, :, i0:i1].unflatten(1, (h, g))
        dob = d_out[:, :, i0:i1].unflatten(1, (h, g))
        rows = lse[..., i0:i1, None]
        delta = (dob.float() * out[:, :, i0:i1].unflatten(1, (h, g)).float()).sum(-1)  # [b, h, g, q]
        docs = None if q_docs is None else q_docs[:, i0:i1]
        dqb = torch.zeros_like(qb, dtype=torch.float32)
        for source, (dk, dv) in zip(sources, grads, strict=True):
            chosen = source.selected is not None
            for j0, j1, mask in plan.pieces(source, i0, i1, docs, q.device):
                k, v = _keys_of(source, j0, j1, i0, i1)
                s = _scores(qb, k, plan.scale, chosen)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                p = (s - rows).exp()
                if chosen:
                    dp = torch.einsum("bhgqd,bhqtd->bhgqt", dob, v).float()
                    ds = p * (dp - delta[..., None]) * plan.scale
                    dqb += torch.einsum("bhgqt,bhqtd->bhgqd", ds.to(k.dtype), k).float()
                    _scatter(dk, source.selected[:, i0:i1], torch.einsum("bhgqt,bhgqd->bhqtd", ds.to(q.dtype), qb))
                    _scatter(dv, source.selected[:, i0:i1], torch.einsum("bhgqt,bhgqd->bhqtd", p.to(q.dtype), dob))
                else:
                    dp = torch.einsum("bhgqd,bhkd->bhgqk", dob, v).float()
                    ds = p * (dp - delta[..., None]) * plan.scale
                    dqb += torch.einsum("bhgqk,bhkd->bhgqd", ds.to(k.dtype), k).float()
                    dk[:, :, j0:j1] += torch.einsum("bhgqk,bhgqd->bhkd", ds.to(q.dtype), qb).float()
                    dv[:, :, j0:j1] += torch.einsum("bhgqk,bhgqd->bhkd", p.to(q.dtype), dob).float()
        dq[:, :, i0:i1] = dqb.flatten(1, 2)
        if sinks is not None:
            p_sink = (sinks.float().view(1, h, g, 1) - rows[..., 0]).exp()
            d_sinks -= (p_sink * delta).sum((0, 3))
    dkv = [grad.to(x.dtype) for source, pair in zip(sources, grads, strict=True)
           for grad, x in zip(pair, (source.k, source.v), strict=True)]
    return dq.to(q.dtype), None if sinks is None else d_sinks.flatten().to(sinks.dtype), dkv


def _scatter(grad: torch.Tensor, index: torch.Tensor, pieces: torch.Tensor) -> None:
    """grad [b, h, n, d] += pieces [b, h, q, t, d] at index [b, q, t] (entries < 0 add nothing: their pieces are
    0, added at 0)."""
    b, h, _, d = grad.shape
    flat = index.clamp(min=0).reshape(b, 1, -1, 1).expand(b, h, -1, d)
    grad.scatter_add_(2, flat, pieces.reshape(b, h, -1, d).float())


# Run eagerly inside a compiled block (a graph break): traced, its loop over blocks would unroll into the graph.
@torch.compiler.disable
def attention(q: torch.Tensor, sources: list[Keys], q_first: int, scale: float, sinks: torch.Tensor | None = None,
              q_documents: torch.Tensor | None = None, picked: bool = False, q_block: int = 0, k_block: int = 0):
    """q [batch, heads, n_q, dk] at positions q_first.. over `sources` (all with the same kv heads and value size),
    one softmax with `sinks` [heads] -> (out [batch, heads, n_q, dv], lse [batch, kv heads, groups, n_q], and with
    `picked` the probabilities of a selected source's keys summed over heads [batch, n_q, top-k], else None).
    `q_block`, `k_block`: block sizes (0: chosen by size)."""
    plan = _Plan(q, sources, q_first, scale, q_block, k_block)
    kv = [t for s in sources for t in (s.k, s.v)]  # k twice where values are keys: one gradient, summed
    return _Attention.apply(plan, picked, q, sinks, q_documents, *kv)


@torch.no_grad()
def max_logits(q: torch.Tensor, sources: list[Keys], q_first: int, scale: float,
               q_documents: torch.Tensor | None = None) -> torch.Tensor:
    """[heads]: the largest score each query head gives a key it sees (QK-clip's S), in fp32, block by block."""
    plan = _Plan(q, sources, q_first, scale, 0, 0)
    h, g = plan.kv_heads, plan.groups
    best = q.new_full((h, g), float("-inf"), dtype=torch.float32)
    for i0, i1 in plan.query_blocks(q.shape[2]):
        qb = q[:, :, i0:i1].unflatten(1, (h, g))
        docs = None if q_documents is None else q_documents[:, i0:i1]
        for source in sources:
            for j0, j1, mask in plan.pieces(source, i0, i1, docs, q.device):
                s = _scores(qb, _keys_of(source, j0, j1, i0, i1)[0], scale, source.selected is not None)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                best = torch.maximum(best, s.amax((0, 3, 4)))
    return best.flatten()
