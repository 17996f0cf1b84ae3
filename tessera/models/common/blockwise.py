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
    """Queries per block: as many as keep a block's scores (and gathered keys) near SCORES_PER_BLOCK, and no more
    than a window or chunk (a block of queries reads the keys of its span plus the window: blocks much longer than
    it would compute mostly masked scores)."""
    per_query, most = 1, n_q
    for s in sources:
        if s.selected is None:
            per_query = max(per_query, batch * q_heads * min(s.k.shape[2], KEY_BLOCK))
            most = min([most, *(n for n in (s.window, s.chunk) if n)])
        else:
            top, kv = s.selected.shape[-1], s.k.shape[1]
            per_query = max(per_query, batch * top * (q_heads + kv * (s.k.shape[-1] + s.v.shape[-1])))
    return max(1, min(most, SCORES_PER_BLOCK // per_query))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, d] as one row per (batch, head, position) [b * h * n, d] (one copy): what a selection gathers
    from and scatters into by row."""
    return x.reshape(-1, x.shape[-1])


def _row_index(index: torch.Tensor, heads: int, n: int) -> torch.Tensor:
    """index [b, q, t] into n positions (clamped to 0 where < 0) -> the rows of _rows' [b * heads * q * t], in
    the order [b, heads, q, t]."""
    b = index.shape[0]
    offsets = torch.arange(b * heads, device=index.device).view(b, heads, 1, 1) * n
    return (index.clamp(min=0).unsqueeze(1) + offsets).flatten()


def _gather(rows: torch.Tensor, index: torch.Tensor, n: int, heads: int) -> torch.Tensor:
    """The rows (_rows') at index [b, q, t] -> [b, heads, q, t, d]."""
    return rows.index_select(0, _row_index(index, heads, n)).view(index.shape[0], heads, *index.shape[1:], -1)


class _Plan:
    """The static part of one call: the query positions, each source's rule by position, block sizes. Every tensor
    (keys, values, documents, selections) goes to autograd as saved tensors, so activation checkpointing governs
    them all."""

    def __init__(self, q: torch.Tensor, sources: list[Keys], q_first: int, scale: float, q_block: int,
                 k_block: int):
        self.q_first, self.scale = q_first, scale
        self.rules = [(s.first, s.stride, s.window, s.chunk, s.v is s.k) for s in sources]
        self.kv_heads = sources[0].k.shape[1]
        self.groups = q.shape[1] // self.kv_heads
        self.q_block = q_block or query_block(q.shape[0], q.shape[1], q.shape[2], sources)
        self.k_block = k_block or KEY_BLOCK

    @staticmethod
    def tensors(sources: list[Keys]) -> list[torch.Tensor | None]:
        """Each source's keys, values, documents and selection, in order (values that are the keys: the keys
        twice, their gradients summed)."""
        return [t for s in sources for t in (s.k, s.v, s.documents, s.selected)]

    def sources(self, tensors) -> list[Keys]:
        """The sources again, from `tensors`' list."""
        out = []
        for i, (first, stride, window, chunk, same) in enumerate(self.rules):
            k, v, documents, selected = tensors[4 * i:4 * i + 4]
            out.append(Keys(k, k if same else v, first, stride, window, chunk, documents, selected))
        return out

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


def _selected_rows(sources: list[Keys]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each source by selection's keys and values as rows (_rows), made once per call."""
    out = []
    for s in sources:
        rows = None
        if s.selected is not None:
            k = _rows(s.k)
            rows = (k, k if s.v is s.k else _rows(s.v))
        out.append(rows)
    return out


def _keys_of(source: Keys, rows, j0, j1, i0: int, i1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's keys and values: [b, h, n, d] by position, [b, h, q, t, d] by selection (from `rows`)."""
    if source.selected is None:
        return source.k[:, :, j0:j1], source.v[:, :, j0:j1]
    index, n, heads = source.selected[:, i0:i1], source.k.shape[2], source.k.shape[1]
    k = _gather(rows[0], index, n, heads)
    return k, k if source.v is source.k else _gather(rows[1], index, n, heads)


def _scores(qs: torch.Tensor, k: torch.Tensor, selected: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """The scaled queries qs [b, h, g, q, d] against keys -> fp32 scores [b, h, g, q, keys], -inf where `mask`
    holds not (a fresh tensor: the callers compute on it in place)."""
    s = torch.einsum("bhgqd,bhqtd->bhgqt" if selected else "bhgqd,bhkd->bhgqk", qs, k)
    s = s.float() if s.dtype != torch.float32 else s
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


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
    picked, rows = None, _selected_rows(sources)
    if want_picked and any(s.selected is not None for s in sources):
        top = next(s.selected for s in sources if s.selected is not None).shape[-1]
        picked = q.new_zeros(b, n_q, top, dtype=torch.float32)
    for i0, i1 in plan.query_blocks(n_q):
        qs = q[:, :, i0:i1].unflatten(1, (h, g)) * plan.scale
        docs = None if q_docs is None else q_docs[:, i0:i1]
        m = q.new_full((b, h, g, i1 - i0), float("-inf"), dtype=torch.float32)
        total, acc = torch.zeros_like(m), q.new_zeros(b, h, g, i1 - i0, dv, dtype=torch.float32)
        kept = None  # the selected keys' exp(score - then max) and that max: their probabilities at the end
        for source, source_rows in zip(sources, rows, strict=True):
            chosen = source.selected is not None
            for j0, j1, mask in plan.pieces(source, i0, i1, docs, q.device):
                k, v = _keys_of(source, source_rows, j0, j1, i0, i1)
                m, total, acc, p, safe = _online(m, total, acc, _scores(qs, k, chosen, mask), v, chosen)
                if chosen:
                    kept = p, safe
        if sinks is not None:
            sink = sinks.float().view(1, h, g, 1).expand_as(m)
            new = torch.maximum(m, sink)
            total = total * (m - new).exp() + (sink - new).exp()
            acc = acc * (m - new).exp()[..., None]
            m = new
        empty = total == 0  # a query that sees no key (none in the selection): output 0
        out[:, :, i0:i1] = (acc / torch.where(empty, 1, total)[..., None]).flatten(1, 2).to(out.dtype)
        lse[..., i0:i1] = torch.where(empty, float("inf"), m + total.log())
        if picked is not None:  # [b, q, top-k], 0 where not selected
            picked[:, i0:i1] = (kept[0] * (kept[1] - lse[..., i0:i1]).exp()[..., None]).sum((1, 2))
    return out, lse, picked


def _online(m, total, acc, s, v, chosen: bool):
    """One piece's scores `s` (consumed) into the running max, total and weighted values; also returns the piece's
    exp(s - max) and that max."""
    new = torch.maximum(m, s.amax(-1))
    safe = torch.where(torch.isinf(new), 0.0, new)  # rows with nothing seen yet
    alpha = (m - safe).exp_()
    p = s.sub_(safe[..., None]).exp_()
    total = total.mul_(alpha).add_(p.sum(-1))
    acc = acc.mul_(alpha[..., None]).add_(_weigh(p.to(v.dtype), v, chosen))
    return new, total, acc, p, safe


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, want_picked: bool, q: torch.Tensor, sinks: torch.Tensor | None,
                q_docs: torch.Tensor | None, *tensors: torch.Tensor | None):
        out, lse, picked = _forward(plan, plan.sources(tensors), q, sinks, q_docs, want_picked)
        ctx.plan = plan
        ctx.save_for_backward(q, sinks, q_docs, out, lse, *tensors)
        ctx.mark_non_differentiable(lse)
        if picked is not None:
            ctx.mark_non_differentiable(picked)
        return out, lse, picked

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, _lse, _picked):
        q, sinks, q_docs, out, lse, *tensors = ctx.saved_tensors
        plan = ctx.plan
        dq, d_sinks, dkv = _backward(plan, plan.sources(tensors), q, sinks, q_docs, out, lse, d_out)
        return (None, None, dq, d_sinks, None, *(g for pair in zip(dkv[::2], dkv[1::2], strict=True)
                                                  for g in (*pair, None, None)))


def _backward(plan: _Plan, sources: list[Keys], q, sinks, q_docs, out, lse, d_out):
    b, hq, n_q, _ = q.shape
    h, g = plan.kv_heads, plan.groups
    dq = torch.zeros_like(q, dtype=torch.float32)
    gathered = _selected_rows(sources)
    grads = [[torch.zeros_like(x, dtype=torch.float32, memory_format=torch.contiguous_format) for x in (s.k, s.v)]
             for s in sources]
    d_sinks = None if sinks is None else torch.zeros(h, g, device=q.device, dtype=torch.float32)
    for i0, i1 in plan.query_blocks(n_q):
        qs = q[:, :, i0:i1].unflatten(1, (h, g)) * plan.scale
        dob = d_out[:, :, i0:i1].unflatten(1, (h, g))
        rows = lse[..., i0:i1, None]
        delta = (dob.float() * out[:, :, i0:i1].unflatten(1, (h, g)).float()).sum(-1)  # [b, h, g, q]
        docs = None if q_docs is None else q_docs[:, i0:i1]
        dqb = torch.zeros_like(qs, dtype=torch.float32)
        for source, source_rows, (dk, dv) in zip(sources, gathered, grads, strict=True):
            chosen = source.selected is not None
            for j0, j1, mask in plan.pieces(source, i0, i1, docs, q.device):
                k, v = _keys_of(source, source_rows, j0, j1, i0, i1)
                p = _scores(qs, k, chosen, mask).sub_(rows).exp_()
                if chosen:
                    ds = torch.einsum("bhgqd,bhqtd->bhgqt", dob, v).float().sub_(delta[..., None]).mul_(p)
                    dqb += torch.einsum("bhgqt,bhqtd->bhgqd", ds.to(k.dtype), k)
                    at = _row_index(source.selected[:, i0:i1], h, source.k.shape[2])  # entries < 0 add 0 at 0
                    _rows(dk).index_add_(0, at, torch.einsum("bhgqt,bhgqd->bhqtd", ds.to(q.dtype), qs)
                                         .reshape(-1, dk.shape[-1]).float())
                    _rows(dv).index_add_(0, at, torch.einsum("bhgqt,bhgqd->bhqtd", p.to(q.dtype), dob)
                                         .reshape(-1, dv.shape[-1]).float())
                else:
                    ds = torch.einsum("bhgqd,bhkd->bhgqk", dob, v).float().sub_(delta[..., None]).mul_(p)
                    dqb += torch.einsum("bhgqk,bhkd->bhgqd", ds.to(k.dtype), k)
                    dk[:, :, j0:j1] += torch.einsum("bhgqk,bhgqd->bhkd", ds.to(q.dtype), qs)
                    dv[:, :, j0:j1] += torch.einsum("bhgqk,bhgqd->bhkd", p.to(q.dtype), dob)
        dq[:, :, i0:i1] = dqb.mul_(plan.scale).flatten(1, 2)  # ds is d/d(scaled scores): dq takes the scale
        if sinks is not None:
            p_sink = (sinks.float().view(1, h, g, 1) - rows[..., 0]).exp()
            d_sinks -= (p_sink * delta).sum((0, 3))
    dkv = [grad.to(x.dtype) for source, pair in zip(sources, grads, strict=True)
           for grad, x in zip(pair, (source.k, source.v), strict=True)]
    return dq.to(q.dtype), None if sinks is None else d_sinks.flatten().to(sinks.dtype), dkv


# Run eagerly inside a compiled block (a graph break): traced, its loop over blocks would unroll into the graph.
@torch.compiler.disable
def attention(q: torch.Tensor, sources: list[Keys], q_first: int, scale: float, sinks: torch.Tensor | None = None,
              q_documents: torch.Tensor | None = None, picked: bool = False, q_block: int = 0, k_block: int = 0):
    """q [batch, heads, n_q, dk] at positions q_first.. over `sources` (all with the same kv heads and value size),
    one softmax with `sinks` [heads] -> (out [batch, heads, n_q, dv], lse [batch, kv heads, groups, n_q], and with
    `picked` the probabilities of a selected source's keys summed over heads [batch, n_q, top-k], else None).
    `q_block`, `k_block`: block sizes (0: chosen by size)."""
    plan = _Plan(q, sources, q_first, scale, q_block, k_block)
    return _Attention.apply(plan, picked, q, sinks, q_documents, *plan.tensors(sources))


@torch.no_grad()
def max_logits(q: torch.Tensor, sources: list[Keys], q_first: int, scale: float,
               q_documents: torch.Tensor | None = None) -> torch.Tensor:
    """[heads]: the largest score each query head gives a key it sees (QK-clip's S), in fp32, block by block."""
    plan = _Plan(q, sources, q_first, scale, 0, 0)
    h, g = plan.kv_heads, plan.groups
    best = q.new_full((h, g), float("-inf"), dtype=torch.float32)
    gathered = _selected_rows(sources)
    for i0, i1 in plan.query_blocks(q.shape[2]):
        qs = q[:, :, i0:i1].unflatten(1, (h, g)) * scale
        docs = None if q_documents is None else q_documents[:, i0:i1]
        for source, rows in zip(sources, gathered, strict=True):
            for j0, j1, mask in plan.pieces(source, i0, i1, docs, q.device):
                s = _scores(qs, _keys_of(source, rows, j0, j1, i0, i1)[0], source.selected is not None, mask)
                best = torch.maximum(best, s.amax((0, 3, 4)))
    return best.flatten()
