"""Attention a block of queries against a block of keys at a time, with an online softmax (the flash-attention
algorithm, in torch): no [queries x keys] tensor lives at once, forward or backward. A custom op (opaque to
torch.compile, so a compiled block calls it whole, checkpointed or not) with its own backward keeps each query's
output and log-sum-exp and recomputes its scores block by block in backward. It is the torch
path of every attention kind (tessera.models.common.attention.CausalSDPA): CPU runs, CUDA where FlexAttention does
not fit (heads wider than 128), decoding, and all-gather context parallel's chunks.

Keys come in sources (`Keys`), all under one softmax, with a learned sink logit per head:
- read by position: key j stands at position first + j * stride (the sequence's keys: 0, 1; DeepSeek V4's entries
  compressing `rate` tokens: at their last token, rate - 1, rate), and a query at position t sees it when it stands
  at or before t, within t's last `window` positions, in t's `chunk`, and in t's document;
- read by selection: `selected` [batch, queries, top-k] indices of the keys each query reads (-1: none), DSA's top-k
  keys and CSA's top-k entries, gathered a block of queries at a time.

Each source is computed alone (its own softmax: an output and a log-sum-exp per query, `Kernels.forward`), and the
sources and sinks merge by their log-sum-exps; backward takes each source's share from the merged output and
log-sum-exp (`Kernels.backward`), as ring attention merges its partial blocks. A source's functions are the unit a
fused kernel replaces (a `Kernels` in KERNELS). Queries are the last positions of the sequence:
query i stands at `q_first + i`. Heads are grouped (GQA, MQA): the query heads of a key head read it without
copies. A block holds about SCORES_PER_BLOCK scores (fp32), so memory grows with the sequence, not its square."""

from collections.abc import Callable
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


def query_block(batch: int, q_heads: int, n_q: int, source: Keys) -> int:
    """Queries per block of `source`: as many as keep a block's scores (and gathered keys) near SCORES_PER_BLOCK,
    and no more than its window or chunk (a block of queries reads the keys of its span plus the window: blocks much
    longer than it would compute mostly masked scores)."""
    if source.selected is not None:
        top, kv = source.selected.shape[-1], source.k.shape[1]
        per_query, most = batch * top * (q_heads + kv * (source.k.shape[-1] + source.v.shape[-1])), n_q
    else:
        per_query = batch * q_heads * min(source.k.shape[2], KEY_BLOCK)
        most = min([n_q, *(n for n in (source.window, source.chunk) if n)])
    return max(1, min(most, SCORES_PER_BLOCK // max(1, per_query)))


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


@dataclass(frozen=True)
class Call:
    """What one attention call shares among its sources: the queries' first position, the scale, the heads' grouping
    and, for tests, block sizes (0: chosen per source)."""
    q_first: int
    scale: float
    kv_heads: int
    q_block: int = 0
    k_block: int = 0

    def query_blocks(self, q: torch.Tensor, source: Keys):
        step = self.q_block or query_block(q.shape[0], q.shape[1], q.shape[2], source)
        for i0 in range(0, q.shape[2], step):
            yield i0, min(i0 + step, q.shape[2])

    def pieces(self, source: Keys, i0: int, i1: int, q_docs: torch.Tensor | None, device):
        """(j0, j1, mask or None where all allowed) of each key block queries i0..i1 may see; for a source by
        selection, one piece (None, None, mask of the selected)."""
        if source.selected is not None:
            yield None, None, (source.selected[:, i0:i1] >= 0)[:, None, None]
            return
        p0, p1 = self.q_first + i0, self.q_first + i1 - 1
        j0, j1 = key_range(source.k.shape[2], p0, p1, source.first, source.stride, source.window, source.chunk)
        q_pos = torch.arange(p0, p1 + 1, device=device)
        for a in range(j0, j1, self.k_block or KEY_BLOCK):
            b = min(a + (self.k_block or KEY_BLOCK), j1)
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

    def blocks(self, q: torch.Tensor, source: Keys, q_docs: torch.Tensor | None):
        """(i0, i1, the scaled queries [b, kv heads, groups, q, d], their documents) of each block of queries."""
        for i0, i1 in self.query_blocks(q, source):
            qs = q[:, :, i0:i1].unflatten(1, (self.kv_heads, -1)) * self.scale
            yield i0, i1, qs, None if q_docs is None else q_docs[:, i0:i1]


def _keys_of(source: Keys, rows, j0, j1, i0: int, i1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's keys and values: [b, h, n, d] by position, [b, h, q, t, d] by selection (from `rows`, the
    source's keys and values as rows: one copy per call)."""
    if source.selected is None:
        return source.k[:, :, j0:j1], source.v[:, :, j0:j1]
    index, n, heads = source.selected[:, i0:i1], source.k.shape[2], source.k.shape[1]
    k = _gather(rows[0], index, n, heads)
    return k, k if source.v is source.k else _gather(rows[1], index, n, heads)


def _source_rows(source: Keys):
    if source.selected is None:
        return None
    k = _rows(source.k)
    return k, k if source.v is source.k else _rows(source.v)


def _scores(qs: torch.Tensor, k: torch.Tensor, selected: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """The scaled queries qs [b, h, g, q, d] against keys -> fp32 scores [b, h, g, q, keys], -inf where `mask`
    holds not (a fresh tensor: the callers compute on it in place)."""
    s = torch.einsum("bhgqd,bhqtd->bhgqt" if selected else "bhgqd,bhkd->bhgqk", qs, k)
    s = s.float() if s.dtype != torch.float32 else s
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


def _weigh(p: torch.Tensor, v: torch.Tensor, selected: bool) -> torch.Tensor:
    return torch.einsum("bhgqt,bhqtd->bhgqd" if selected else "bhgqk,bhkd->bhgqd", p, v)


def source_forward(call: Call, source: Keys, q: torch.Tensor, q_docs: torch.Tensor | None,
                   rest: torch.Tensor | None = None):
    """One source's own softmax, torch: (each query's output over its keys, fp32 [b, kv heads, groups, n_q, dv]; its
    log-sum-exp [b, kv heads, groups, n_q], -inf where it sees none of them; with `rest`, the log-sum-exp of the
    rest of the softmax (the other sources and the sinks), a source by selection's keys' probabilities in the whole
    softmax summed over heads [b, n_q, top-k], else None)."""
    b, _, n_q, _ = q.shape
    h = call.kv_heads
    out = q.new_empty(b, h, q.shape[1] // h, n_q, source.v.shape[-1], dtype=torch.float32)
    lse = q.new_empty(b, h, q.shape[1] // h, n_q, dtype=torch.float32)
    rows, chosen = _source_rows(source), source.selected is not None
    probs = None if rest is None else q.new_zeros(*source.selected.shape, dtype=torch.float32)
    for i0, i1, qs, docs in call.blocks(q, source, q_docs):
        m = q.new_full(qs.shape[:-1], float("-inf"), dtype=torch.float32)
        total, acc = torch.zeros_like(m), torch.zeros_like(out[..., i0:i1, :])
        for j0, j1, mask in call.pieces(source, i0, i1, docs, q.device):
            k, v = _keys_of(source, rows, j0, j1, i0, i1)
            s = _scores(qs, k, chosen, mask)
            new = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(new), 0.0, new)  # rows with nothing seen yet
            alpha = (m - safe).exp_()
            p = s.sub_(safe[..., None]).exp_()
            total, m = total.mul_(alpha).add_(p.sum(-1)), new
            acc = acc.mul_(alpha[..., None]).add_(_weigh(p.to(v.dtype), v, chosen))
        out[..., i0:i1, :] = acc / total.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
        lse[..., i0:i1] = m + total.log()  # -inf (log 0) where it saw none
        if probs is not None:  # a selection is one piece: p is exp(scores - m), m its max
            whole = torch.logaddexp(lse[..., i0:i1], rest[..., i0:i1])
            probs[:, i0:i1] = (p * (m - whole).nan_to_num(neginf=float("-inf")).exp()[..., None]).sum((1, 2))
    return out, lse, probs


def source_backward(call: Call, source: Keys, q: torch.Tensor, q_docs: torch.Tensor | None, lse: torch.Tensor,
                    d_out: torch.Tensor, delta: torch.Tensor):
    """One source's share of the gradients, torch, from the merged softmax's log-sum-exp `lse` [b, h, g, n_q]
    (+inf where a query saw nothing), the output's gradient `d_out` [b, heads, n_q, dv] and delta = rowsum(d_out x
    out) [b, h, g, n_q] -> (dq fp32 [b, heads, n_q, dk], dk fp32, dv fp32, in k's and v's shapes)."""
    h = call.kv_heads
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = (torch.zeros_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
              for x in (source.k, source.v))
    rows, chosen = _source_rows(source), source.selected is not None
    for i0, i1, qs, docs in call.blocks(q, source, q_docs):
        dob = d_out[:, :, i0:i1].unflatten(1, (h, -1))
        rows_lse, rows_delta = lse[..., i0:i1, None], delta[..., i0:i1, None]
        dqb = torch.zeros_like(qs, dtype=torch.float32)
        for j0, j1, mask in call.pieces(source, i0, i1, docs, q.device):
            k, v = _keys_of(source, rows, j0, j1, i0, i1)
            p = _scores(qs, k, chosen, mask).sub_(rows_lse).exp_()
            if chosen:
                ds = torch.einsum("bhgqd,bhqtd->bhgqt", dob, v).float().sub_(rows_delta).mul_(p)
                dqb += torch.einsum("bhgqt,bhqtd->bhgqd", ds.to(k.dtype), k)
                at = _row_index(source.selected[:, i0:i1], h, source.k.shape[2])  # entries < 0 add 0 at row 0
                _rows(dk).index_add_(0, at, torch.einsum("bhgqt,bhgqd->bhqtd", ds.to(q.dtype), qs)
                                     .reshape(-1, dk.shape[-1]).float())
                _rows(dv).index_add_(0, at, torch.einsum("bhgqt,bhgqd->bhqtd", p.to(q.dtype), dob)
                                     .reshape(-1, dv.shape[-1]).float())
            else:
                ds = torch.einsum("bhgqd,bhkd->bhgqk", dob, v).float().sub_(rows_delta).mul_(p)
                dqb += torch.einsum("bhgqk,bhkd->bhgqd", ds.to(k.dtype), k)
                dk[:, :, j0:j1] += torch.einsum("bhgqk,bhgqd->bhkd", ds.to(q.dtype), qs)
                dv[:, :, j0:j1] += torch.einsum("bhgqk,bhgqd->bhkd", p.to(q.dtype), dob)
        dq[:, :, i0:i1] = dqb.mul_(call.scale).flatten(1, 2)  # ds is d/d(scaled scores): dq takes the scale
    return dq, dk, dv


@dataclass(frozen=True)
class Kernels:
    """A source's functions (source_forward's and source_backward's arguments); `takes(source, q)`: whether they
    compute it (others fall back to torch's)."""
    forward: Callable
    backward: Callable
    takes: Callable = lambda source, q: True  # noqa: E731


TORCH = Kernels(source_forward, source_backward)


def _kernels_for(kernels: Kernels, source: Keys, q: torch.Tensor) -> Kernels:
    return kernels if kernels.takes(source, q) else TORCH


def _sink_lse(sinks: torch.Tensor | None, q: torch.Tensor, kv_heads: int) -> torch.Tensor | None:
    if sinks is None:
        return None
    return sinks.float().view(1, kv_heads, -1, 1).expand(q.shape[0], kv_heads, q.shape[1] // kv_heads, q.shape[2])


def _merge(parts, sink: torch.Tensor | None):
    """The sources' (outputs, log-sum-exps) and the sinks' logits as one softmax -> (out fp32 [b, h, g, n_q, dv],
    lse [b, h, g, n_q]; +inf where a query sees nothing, so its probabilities in backward are 0)."""
    lse = torch.logsumexp(torch.stack([part[1] for part in parts] + ([sink] if sink is not None else [])), dim=0)
    seen = torch.isfinite(lse)
    out = sum(part[0] * torch.where(seen, (part[1] - lse).exp(), 0.0)[..., None] for part in parts)
    return out, torch.where(seen, lse, float("inf"))


KERNELS = {"torch": TORCH}  # by name: a custom op's arguments are tensors, numbers and strings


def _sources(rules: list[int], tensors) -> list[Keys]:
    """The sources from their rules (first, stride, window, chunk, and whether values are keys, documents and a
    selection are given: seven numbers each) and their tensors (keys, values, documents, selection: four each, a
    placeholder where not given)."""
    out = []
    for i in range(len(tensors) // 4):
        first, stride, window, chunk, same, has_documents, has_selected = rules[7 * i:7 * i + 7]
        k, v, documents, selected = tensors[4 * i:4 * i + 4]
        out.append(Keys(k, k if same else v, first, stride, window, chunk, documents if has_documents else None,
                        selected if has_selected else None))
    return out


# A custom op, opaque to the compiler: traced, its loop over blocks would unroll into the graph (and a graph break
# is no option inside a checkpointed, whole-graph-compiled block).
@torch.library.custom_op("tessera::blockwise_attention", mutates_args=())
def _forward(q: torch.Tensor, sinks: torch.Tensor | None, q_docs: torch.Tensor | None,
             tensors: list[torch.Tensor], rules: list[int], q_first: int, scale: float, kv_heads: int,
             q_block: int, k_block: int, want_picked: bool,
             kernels: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call, sources = Call(q_first, scale, kv_heads, q_block, k_block), _sources(rules, tensors)
    sink = _sink_lse(sinks, q, kv_heads)
    # the sources by position first: a selection's probabilities are taken in its pass, from the rest's total
    parts = [_kernels_for(KERNELS[kernels], s, q).forward(call, s, q, q_docs) for s in sources if s.selected is None]
    picked = q.new_empty(0, dtype=torch.float32)
    for source in (s for s in sources if s.selected is not None):
        rest = None
        if want_picked:
            others = [part[1] for part in parts] + ([sink] if sink is not None else [])
            rest = torch.logsumexp(torch.stack(others), dim=0) if others else \
                q.new_full((q.shape[0], kv_heads, q.shape[1] // kv_heads, q.shape[2]), float("-inf"),
                           dtype=torch.float32)
        parts.append(_kernels_for(KERNELS[kernels], source, q).forward(call, source, q, q_docs, rest))
        picked = parts[-1][2] if want_picked else picked
    out, lse = _merge(parts, sink)
    return out.flatten(1, 2).to(q.dtype).contiguous(), lse.contiguous(), picked.contiguous()


@_forward.register_fake
def _(q, sinks, q_docs, tensors, rules, q_first, scale, kv_heads, q_block, k_block, want_picked, kernels):
    b, heads, n_q, _ = q.shape
    selected = [t for t, given in zip(tensors[3::4], rules[6::7], strict=True) if given]
    picked = selected[-1].shape if want_picked and selected else (0,)
    return (q.new_empty(b, heads, n_q, tensors[1].shape[-1]),
            q.new_empty(b, kv_heads, heads // kv_heads, n_q, dtype=torch.float32),
            q.new_empty(picked, dtype=torch.float32))


@torch.library.custom_op("tessera::blockwise_attention_backward", mutates_args=())
def _backward(d_out: torch.Tensor, q: torch.Tensor, sinks: torch.Tensor | None, q_docs: torch.Tensor | None,
              out: torch.Tensor, lse: torch.Tensor, tensors: list[torch.Tensor], rules: list[int],
              q_first: int, scale: float, kv_heads: int, q_block: int, k_block: int,
              kernels: str) -> list[torch.Tensor]:
    """-> [dq, the sinks' gradient (empty without sinks), then each source's keys' and values' gradients]."""
    call, h = Call(q_first, scale, kv_heads, q_block, k_block), kv_heads
    delta = (d_out.float() * out.float()).sum(-1).unflatten(1, (h, -1))
    dq, grads = torch.zeros(q.shape, dtype=torch.float32, device=q.device), []
    for source in _sources(rules, tensors):
        dq_s, dk, dv = _kernels_for(KERNELS[kernels], source, q).backward(call, source, q, q_docs, lse, d_out, delta)
        dq += dq_s
        grads += [dk.to(source.k.dtype).contiguous(), dv.to(source.v.dtype).contiguous()]
    d_sinks = q.new_empty(0)
    if sinks is not None:  # a sink's gradient: -sum over queries of its probability times delta
        d_sinks = -((sinks.float().view(1, h, -1, 1) - lse).exp() * delta).sum((0, 3)).flatten().to(sinks.dtype)
    return [dq.to(q.dtype), d_sinks, *grads]


@_backward.register_fake
def _(d_out, q, sinks, q_docs, out, lse, tensors, rules, q_first, scale, kv_heads, q_block, k_block, kernels):
    keys = [t for i in range(0, len(tensors), 4) for t in tensors[i:i + 2]]
    return [torch.empty(q.shape, dtype=q.dtype, device=q.device),
            q.new_empty(0) if sinks is None else torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device),
            *(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in keys)]


def _keep_for_backward(ctx, inputs, output):
    q, sinks, q_docs, tensors, rules, q_first, scale, kv_heads, q_block, k_block, _, kernels = inputs
    ctx.save_for_backward(q, sinks, q_docs, output[0], output[1], *tensors)
    ctx.args = (rules, q_first, scale, kv_heads, q_block, k_block, kernels)


def _gradients(ctx, d_out, _lse, _picked):
    q, sinks, q_docs, out, lse, *tensors = ctx.saved_tensors
    dq, d_sinks, *grads = _backward(d_out.contiguous(), q, sinks, q_docs, out, lse, tensors, *ctx.args)
    per_tensor = [g for i in range(0, len(grads), 2) for g in (grads[i], grads[i + 1], None, None)]
    return dq, None if sinks is None else d_sinks, None, per_tensor, *([None] * 8)


_forward.register_autograd(_gradients, setup_context=_keep_for_backward)


def attention(q: torch.Tensor, sources: list[Keys], q_first: int, scale: float, sinks: torch.Tensor | None = None,
              q_documents: torch.Tensor | None = None, picked: bool = False, kernels: str = "torch",
              q_block: int = 0, k_block: int = 0):
    """q [batch, heads, n_q, dk] at positions q_first.. over `sources` (all with the same kv heads and value size),
    one softmax with `sinks` [heads] -> (out [batch, heads, n_q, dv], lse [batch, kv heads, groups, n_q], and with
    `picked` the probabilities of the selected source's keys summed over heads [batch, n_q, top-k], else None).
    `kernels`: the name of a source's functions in KERNELS (torch's by default); `q_block`, `k_block`: block sizes
    (0: chosen by size). Every tensor (keys, values, documents, selections) is saved for backward as autograd's, so
    activation checkpointing governs them all."""
    rules = [x for s in sources for x in (s.first, s.stride, s.window, s.chunk, int(s.v is s.k),
                                          int(s.documents is not None), int(s.selected is not None))]
    none = q.new_empty(0)  # a list's None has no gradient's place: a placeholder stands for none
    tensors = [none if t is None else t for s in sources for t in (s.k, s.v, s.documents, s.selected)]
    out, lse, chosen = _forward(q, sinks, q_documents, tensors, rules, q_first, scale, sources[0].k.shape[1],
                                q_block, k_block, picked, kernels)
    return out, lse, chosen if picked else None


@torch.no_grad()
def max_logits(q: torch.Tensor, sources: list[Keys], q_first: int, scale: float,
               q_documents: torch.Tensor | None = None) -> torch.Tensor:
    """[heads]: the largest score each query head gives a key it sees (QK-clip's S), in fp32, block by block."""
    call = Call(q_first, scale, sources[0].k.shape[1])
    best = q.new_full((q.shape[1],), float("-inf"), dtype=torch.float32)
    for source in sources:
        rows = _source_rows(source)
        for i0, i1, qs, docs in call.blocks(q, source, q_documents):
            for j0, j1, mask in call.pieces(source, i0, i1, docs, q.device):
                s = _scores(qs, _keys_of(source, rows, j0, j1, i0, i1)[0], source.selected is not None, mask)
                best = torch.maximum(best, s.amax((0, 3, 4)).flatten())
    return best
