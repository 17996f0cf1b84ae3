"""Sparse attention's selection, shared by every lightning indexer (DeepSeek V3.2's and GLM-5's DSA, DeepSeek V4's
CSA: tessera/models/deepseek): an indexer scores the keys each query may pick, I[t, s] = sum_h w[t, h] relu(q[t, h] .
k[s] / sqrt(d)) (w with 1 / sqrt(heads) in it); each query attends the top-k (top_k); the indexer learns by
KL(p || softmax(I)), p the main attention's probabilities summed over heads (indexer_kl). Nothing here keeps
[queries x keys]: the top-k is taken a block of queries at a time (their rows' scores, then only the indices), and
the KL is computed a block at a time with its gradients, over the selected keys (memory O(queries x top-k)) or, in a
dense warm-up, over every key a query may pick."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.common import blockwise


@dataclass(frozen=True)
class Scoring:
    """What an indexer scores with, and which keys a query may pick: q [batch, n_q, heads, dim] (RoPE'd), w
    [batch, n_q, heads] (each head's weight, 1 / sqrt(heads) in it), k [batch, n_k, dim] (one key per token, or per
    compressed entry); query i stands at position q_first + i (or, with `spans`, the queries are runs of positions:
    context parallel's two chunks), key j at first + j * stride, and a query may pick the keys at or before it, of its
    document (`q_documents` [batch, n_q], `k_documents` [batch, n_k])."""
    q: torch.Tensor
    w: torch.Tensor
    k: torch.Tensor
    scale: float  # 1 / sqrt(dim)
    q_first: int = 0
    first: int = 0
    stride: int = 1
    q_documents: torch.Tensor | None = None
    k_documents: torch.Tensor | None = None
    spans: tuple[tuple[int, int, int], ...] = ()  # (first query, end, position of the first): runs of positions in
    # order; () : one run from q_first

    def blocks(self, per_query: int):
        """(i0, i1) of each block of queries, within one run of positions, about SCORES_PER_BLOCK // per_query
        long."""
        step = max(1, blockwise.SCORES_PER_BLOCK // max(1, per_query))
        for a, b, _ in self.spans or ((0, self.q.shape[1], self.q_first),):
            for i0 in range(a, b, step):
                yield i0, min(i0 + step, b)

    def position(self, i: int) -> int:
        """Query i's position."""
        for a, b, p in self.spans or ((0, self.q.shape[1], self.q_first),):
            if a <= i < b:
                return p + i - a
        raise IndexError(i)

    def key_end(self, i1: int) -> int:
        """The keys [0, end) query i1 - 1 (the last of a block: its run's latest) may pick."""
        return blockwise.key_range(self.k.shape[1], 0, self.position(i1 - 1), self.first, self.stride)[1]

    def mask(self, i0: int, i1: int, end: int) -> torch.Tensor:
        """[1 or batch, i1 - i0, end] bool: the keys queries i0..i1 (of one run) may pick, of [0, end)."""
        device = self.k.device
        q_pos = torch.arange(self.position(i0), self.position(i0) + i1 - i0, device=device)
        k_pos = self.first + torch.arange(end, device=device) * self.stride
        return blockwise.rule_mask(q_pos, k_pos, 0, 0,
                                   None if self.q_documents is None else self.q_documents[:, i0:i1],
                                   None if self.k_documents is None else self.k_documents[:, :end])

    def pre(self, i0: int, i1: int, keys: torch.Tensor) -> torch.Tensor:
        """q . k / sqrt(d) before the relu, fp32: [batch, q, heads, n] against keys [batch, n, dim], or against
        each query's own [batch, q, n, dim]."""
        q = self.q[:, i0:i1].float()
        if keys.dim() == 4:
            return torch.einsum("bqhd,bqnd->bqhn", q, keys.float()) * self.scale
        return torch.einsum("bqhd,bnd->bqhn", q, keys.float()) * self.scale

    def logits(self, i0: int, i1: int, end: int, width: int) -> torch.Tensor:
        """[batch, q, width] fp32: queries i0..i1's logits over keys [0, end), -inf at and after `end` and where a
        query may not pick; computed a block of keys at a time (heads x keys at once)."""
        b, heads = self.q.shape[0], self.q.shape[2]
        out = self.q.new_full((b, i1 - i0, width), float("-inf"), dtype=torch.float32)
        step = max(1, blockwise.SCORES_PER_BLOCK // (b * (i1 - i0) * heads))
        w = self.w[:, i0:i1].float()
        for j in range(0, end, step):
            part = self.pre(i0, i1, self.k[:, j:min(j + step, end)])
            out[..., j:j + part.shape[-1]] = torch.einsum("bqh,bqhn->bqn", w, F.relu(part))
        if end:
            out[..., :end].masked_fill_(~self.mask(i0, i1, end), float("-inf"))
        return out


def _scoring_args(scoring: Scoring) -> tuple:
    """A Scoring as a custom op's arguments (tensors detached: the ops' gradients are their own)."""
    spans = [x for run in scoring.spans for x in run]
    return (scoring.q.detach(), scoring.w.detach(), scoring.k.detach(), scoring.q_documents, scoring.k_documents,
            scoring.scale, scoring.q_first, scoring.first, scoring.stride, spans)


def _scoring(q, w, k, q_documents, k_documents, scale, q_first, first, stride, spans) -> Scoring:
    return Scoring(q, w, k, scale, q_first, first, stride, q_documents, k_documents,
                   tuple(zip(spans[0::3], spans[1::3], spans[2::3], strict=True)))


# Custom ops, opaque to the compiler: traced, their loops over blocks would unroll into the graph (and a graph break
# in a compiled block would split it where the indexer runs).
@torch.library.custom_op("tessera::index_top_k", mutates_args=())
def _top_k(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_documents: torch.Tensor | None,
           k_documents: torch.Tensor | None, scale: float, q_first: int, first: int, stride: int, spans: list[int],
           topk: int, stable: bool) -> torch.Tensor:
    scoring = _scoring(q, w, k, q_documents, k_documents, scale, q_first, first, stride, spans)
    b, n_q, n_k = scoring.q.shape[0], scoring.q.shape[1], scoring.k.shape[1]
    width = min(topk, n_k)
    out = torch.full((b, n_q, width), -1, dtype=torch.long, device=scoring.k.device)
    for i0, i1 in scoring.blocks(b * n_k):
        rows = scoring.logits(i0, i1, scoring.key_end(i1), n_k)
        if stable:
            values, picks = rows.sort(dim=-1, descending=True, stable=True)
            values, picks = values[..., :width], picks[..., :width]
        else:
            values, picks = rows.topk(width, dim=-1)
        out[:, i0:i1] = picks.masked_fill(values == float("-inf"), -1)
    return out


@_top_k.register_fake
def _(q, w, k, q_documents, k_documents, scale, q_first, first, stride, spans, topk, stable):
    return q.new_empty(q.shape[0], q.shape[1], torch.sym_min(topk, k.shape[1]), dtype=torch.long)


def top_k(scoring: Scoring, topk: int, stable: bool = False) -> torch.Tensor:
    """[batch, n_q, min(topk, n_k)] int64: the keys each query ranks highest among those it may pick (-1 where fewer
    are). A row's scores span all n_k keys (those after the block masked), so which of equal scores torch's topk
    keeps is what it keeps over the whole row (it depends on the row's length). `stable`: equal scores (the relu's
    zeros) go to the earlier key, whatever the shapes (decoding, a document packed elsewhere)."""
    return _top_k(*_scoring_args(scoring), topk, stable)


class WithGradients(torch.autograd.Function):
    """`value`, whose gradients with respect to `inputs` were computed with it (in no_grad blocks): backward scales
    them by the incoming gradient. Saved as tensors, so activation checkpointing recomputes them with the rest."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, n: int, *inputs_then_gradients: torch.Tensor) -> torch.Tensor:
        ctx.n = n
        ctx.save_for_backward(*inputs_then_gradients[n:])
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, *(grad.to(g.dtype) * g for g in ctx.saved_tensors), *([None] * ctx.n))


def _kl_rows(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, KL(p || softmax(logits)) over the keys logits allow (finite), p L1-normalized there; and its
    gradient with respect to the logits, [batch, q, n]."""
    ok = logits > float("-inf")
    p = p.float().masked_fill(~ok, 0.0)
    total = p.sum(-1, keepdim=True)
    p = p / total.clamp(min=1e-20)
    log_q = logits.log_softmax(-1).masked_fill(~ok, 0.0)
    kl = (torch.xlogy(p, p) - p * log_q).sum(-1)
    grad = (log_q.exp() * (total > 0) - p).masked_fill(~ok, 0.0)
    return kl, grad


@torch.no_grad()
def _kl_and_gradients(scoring: Scoring, target, selected: torch.Tensor | None):
    """(sum over queries of the KL, d/dq, d/dk, d/dw), a block of queries at a time."""
    q, k, w = scoring.q, scoring.k, scoring.w
    b, n_q, heads, dim = q.shape
    dq, dk, dw = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, w))
    total = q.new_zeros((), dtype=torch.float32)
    width = selected.shape[-1] if selected is not None else k.shape[1]
    for i0, i1 in scoring.blocks(b * width * (heads + (dim if selected is not None else 0))):
        wb = w[:, i0:i1].float()
        if selected is not None:
            index = selected[:, i0:i1]
            rows = (index.clamp(min=0) + torch.arange(b, device=k.device).view(-1, 1, 1) * k.shape[1]).flatten()
            keys = k.reshape(-1, dim).index_select(0, rows).view(b, i1 - i0, -1, dim)
            pre = scoring.pre(i0, i1, keys)  # [b, q, heads, top-k]
            logits = torch.einsum("bqh,bqhn->bqn", wb, F.relu(pre)).masked_fill(index < 0, float("-inf"))
            kl, grad = _kl_rows(logits, target[:, i0:i1])
            dw[:, i0:i1] = torch.einsum("bqn,bqhn->bqh", grad, F.relu(pre))
            dpre = grad[:, :, None] * wb[..., None] * (pre > 0) * scoring.scale
            dq[:, i0:i1] = torch.einsum("bqhn,bqnd->bqhd", dpre, keys.float())
            dk.view(-1, dim).index_add_(0, rows, torch.einsum("bqhn,bqhd->bqnd", dpre, q[:, i0:i1].float())
                                        .reshape(-1, dim))
        else:
            end = scoring.key_end(i1)
            logits = scoring.logits(i0, i1, end, end)
            kl, grad = _kl_rows(logits, target(i0, i1, end))
            step = max(1, blockwise.SCORES_PER_BLOCK // (b * (i1 - i0) * heads))
            for j in range(0, end, step):
                stop = min(j + step, end)
                pre = scoring.pre(i0, i1, k[:, j:stop])
                g = grad[..., j:stop]
                dw[:, i0:i1] += torch.einsum("bqn,bqhn->bqh", g, F.relu(pre))
                dpre = g[:, :, None] * wb[..., None] * (pre > 0) * scoring.scale
                dq[:, i0:i1] += torch.einsum("bqhn,bnd->bqhd", dpre, k[:, j:stop].float())
                dk[:, j:stop] += torch.einsum("bqhn,bqhd->bnd", dpre, q[:, i0:i1].float())
        total += kl.sum()
    return total, dq, dk, dw


@torch.library.custom_op("tessera::index_kl_selected", mutates_args=())
def _kl_selected(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_documents: torch.Tensor | None,
                 k_documents: torch.Tensor | None, scale: float, q_first: int, first: int, stride: int,
                 spans: list[int], target: torch.Tensor,
                 selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_kl_and_gradients over the selected keys, as a custom op (as top_k)."""
    scoring = _scoring(q, w, k, q_documents, k_documents, scale, q_first, first, stride, spans)
    return tuple(x.contiguous() for x in _kl_and_gradients(scoring, target, selected))


@_kl_selected.register_fake
def _(q, w, k, q_documents, k_documents, scale, q_first, first, stride, spans, target, selected):
    return (q.new_empty((), dtype=torch.float32),
            *(torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, w)))


# over every key (a dense warm-up), the target is a function of each block: eagerly inside a compiled block
_kl_over_every_key = torch.compiler.disable(_kl_and_gradients)


def indexer_kl(scoring: Scoring, target, selected: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over queries of KL(p || softmax(I)), I the indexer's logits: over the `selected` keys [batch, n_q,
    top-k] with `target` p [batch, n_q, top-k] (the heads' summed attention probabilities of those keys, HeadSum's),
    or, `selected` None, over every key a query may pick with `target(i0, i1, end)` giving queries i0..i1's p over
    keys [0, end). No gradient into p; the gradients of q, k and w are computed with the loss, a block at a time."""
    if selected is None:
        value, dq, dk, dw = _kl_over_every_key(scoring, target, None)
    else:
        value, dq, dk, dw = _kl_selected(*_scoring_args(scoring), target.detach(), selected)
    n = scoring.q.shape[0] * scoring.q.shape[1]  # the gradients kept in their inputs' dtypes, as autograd makes them
    inputs = (scoring.q, scoring.k, scoring.w)
    return WithGradients.apply(value / n, 3, *inputs, *((g / n).to(x.dtype) for g, x in zip((dq, dk, dw), inputs,
                                                                                             strict=True)))


class LightningIndexer(nn.Module):
    """What an indexer (V3.2's, V4's CSA) picks and learns with: a module of the model, so that tessera.estimate can
    give its traced models the memory of fused kernels in place of these loops (use_index_kernels)."""

    top_k = staticmethod(top_k)
    kl = staticmethod(indexer_kl)


def use_index_kernels(model: nn.Module, pick: Callable, kl: Callable) -> nn.Module:
    """`model`'s indexers pick with `pick` (top_k's arguments) and compute their loss with `kl` (indexer_kl's)."""
    for indexer in model.modules():
        if isinstance(indexer, LightningIndexer):
            indexer.top_k, indexer.kl = pick, kl
    return model


class HeadSum(nn.Module):
    """Attention probabilities summed over the heads this rank holds ([batch, heads, ...] -> [batch, ...], or
    already summed: as given): the indexer's target. A module of its own, so that tensor parallelism, whose ranks
    each hold some heads, sums the others' in (tessera.parallel.tp.SummedOverRanks)."""

    def forward(self, probs: torch.Tensor, summed: bool = False) -> torch.Tensor:
        return probs if summed else probs.sum(1)
