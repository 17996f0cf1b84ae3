"""DeepSeek V4's attention: one key/value head that every query head shares (keys are values), a learned sink per
head, a sliding window over the uncompressed keys, and in compressed blocks entries that each compress several
tokens: all of them (HCA) or those a lightning indexer ranks highest for each query (CSA).

RoPE turns each head's trailing `rope_head_dim` dims in pairs; since values are keys, the output's trailing dims
are turned back by the query's angle (so each value enters at its distance from the query). The output projection
is grouped: heads in `o_groups` groups, each projected to `o_lora_rank`, then mixed to the model's width.

CSA's indexer learns as DeepSeek V3.2's (the scoring, top-k and loss are tessera/models/common/sparse.py's), sparse:
its scores, softmaxed over the entries it picked, fitted by KL to the heads' summed attention probabilities over
them; its inputs detached.

The attention computes in the shared kernel (CausalSDPA: the window over the sequence's key/value head, the
entries, all visible (HCA) or those selected (CSA), one softmax over both and the sink), block by block: no
[queries x keys] or [queries x entries] tensor. Packed documents: a query sees no key before its document's start,
and no entry whose window starts before it; CSA's reach back stops at a document's start. A document that starts
on a multiple of the rates gets the entries it gets alone."""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.common import sparse
from tessera.models.common.attention import CausalSDPA, Entries
from tessera.models.common.side_loss import SideLoss
from tessera.models.deepseek.v4.args import CSA


def local(t: torch.Tensor) -> torch.Tensor:
    """Under TP a rank holds some heads' sinks and groups' output weights (DTensors): the math runs on its own."""
    return t.to_local() if isinstance(t, DTensor) else t


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tail(x: torch.Tensor, rope: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [batch, seq, heads, dim] with its last rope dims turned in pairs (0, 1), (2, 3)...; rope [seq, 2, rope] or
    per token [batch, seq, 2, rope] (tessera.models.common.rope.rope_table's: each angle twice, halves)."""
    half = rope.shape[-1] // 2
    cos, sin = (rope[..., i, :half].unsqueeze(-2).to(x.dtype) for i in (0, 1))
    if inverse:
        sin = -sin
    kept, turned = x.split([x.shape[-1] - 2 * half, 2 * half], dim=-1)
    a, b = turned[..., 0::2], turned[..., 1::2]
    return torch.cat([kept, torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)], dim=-1)


class Compressor(nn.Module):
    """One entry [head_dim] per `rate` tokens: the tokens' projections `wkv` averaged by a softmax over them of
    their gates `wgate` plus a learned bias per slot (`ape`), normed, RoPE'd at the window's first position.
    `overlap` (CSA's): each token projects two series; entry w mixes window w - 1's first with window w's second
    (2 x rate slots, stride rate). A trailing part window makes no entry."""

    def __init__(self, dim: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = nn.RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, dim], `rope` its positions' rows -> entries [batch, seq // rate, head_dim]. With
        `documents`, CSA's reach back takes no token of another document than its window's first token's."""
        bsz, seq, _ = x.shape
        n, m, d = seq // self.rate, self.rate, self.head_dim
        if n == 0:
            return x.new_zeros(bsz, 0, d)
        x = x[:, :n * m]
        kv = self.wkv(x).view(bsz, n, m, -1)
        gate = self.wgate(x).view(bsz, n, m, -1) + self.ape.to(x.dtype)
        if self.overlap:  # window -1 (before the sequence) weighs nothing
            before = F.pad(gate[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            if documents is not None:
                windows = documents[:, :n * m].view(bsz, n, m)
                other = F.pad(windows[:, :-1], (0, 0, 1, 0)) != windows[:, :, :1]
                before = before.masked_fill(other.unsqueeze(-1), float("-inf"))
            kv = torch.cat([F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0)), kv[..., d:]], dim=2)
            gate = torch.cat([before, gate[..., d:]], dim=2)
        entries = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(2))
        return rope_tail(entries.unsqueeze(2), rope[..., :n * m:m, :, :]).squeeze(2)


class Indexer(sparse.LightningIndexer):
    """CSA's lightning indexer: its own compressor (index_head_dim) over the same windows, queries from the query's
    bottleneck; I[t, s] = sum_h w[t, h] / sqrt(H) * relu(q[t, h] . k[s] / sqrt(d)) (sparse.Scoring's)."""

    def __init__(self, args):
        super().__init__()
        self.heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.compressor = Compressor(args.dim, args.index_head_dim, args.csa_rate, True, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, args.index_n_heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor,
                documents: torch.Tensor | None = None, keys: torch.Tensor | None = None,
                key_documents: torch.Tensor | None = None) -> sparse.Scoring:
        """The queries' scoring over the compressed entries (entry j picked from its window's last token on, in its
        first token's document): its compressor's of x, or `keys` given with their `key_documents` (context parallel's
        whole sequence's)."""
        bsz, seq, _ = x.shape
        rate = self.compressor.rate
        if keys is None:
            keys = self.compressor(x, rope, documents)
            key_documents = None if documents is None else entry_documents(documents, rate, keys.shape[1])
        q = rope_tail(self.wq_b(q_latent).view(bsz, seq, self.heads, self.head_dim), rope)
        return sparse.Scoring(q, self.weights_proj(x) * self.heads ** -0.5, keys, self.head_dim ** -0.5,
                              first=rate - 1, stride=rate, q_documents=documents, k_documents=key_documents)


def entry_documents(documents: torch.Tensor, rate: int, n: int) -> torch.Tensor:
    """[batch, n]: the document of each entry's first token (a query of another document never sees it)."""
    return documents[:, :n * rate:rate]


class SharedKV(nn.Module):
    """The one key/value head: projected and normed (a module of its own: every query head reads it, so under TP
    its gradient is summed over the ranks' heads)."""

    def __init__(self, dim: int, head_dim: int, eps: float):
        super().__init__()
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        self.norm = nn.RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.wkv(x))


class GroupedLinear(nn.Linear):
    """Block-diagonal: `groups` groups of the input, each its own [out / groups, in / groups] map. The groups
    held are weight rows / (out / groups): under TP a rank's heads' groups."""

    def __init__(self, in_per_group: int, out: int, groups: int):
        super().__init__(in_per_group, out, bias=False)
        self.out_per_group = out // groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = local(self.weight)
        w = w.view(-1, self.out_per_group, w.shape[-1])
        return torch.einsum("bsgi,goi->bsgo", x.unflatten(-1, (len(w), -1)), w).flatten(-2)


class Parts(NamedTuple):
    """What a V4 block attends with (its own modules and settings), handed to its core."""
    compressor: Compressor | None  # None: a sliding block
    indexer: Indexer | None  # CSA's
    sdpa: CausalSDPA  # the attention kernel (its window and sinks)
    head_sum: nn.Module | None
    loss: SideLoss | None  # the indexer's
    rate: int
    topk: int


def attend(parts: Parts, q: torch.Tensor, runs: list[tuple], entries: torch.Tensor | None,
           entry_docs: torch.Tensor | None, scoring: sparse.Scoring | None, training: bool) -> torch.Tensor:
    """Runs of queries, each q[:, :, a:b] against its `keys` [batch, 1, n, dim] (the run's own and the window's
    before it; key 0 at position `first`, the run's queries the last of them, `docs` their documents) for `runs` of
    (a, b, first, keys, docs), the compressed `entries` [batch, n, dim] (HCA: every one it sees; CSA: the indexer's
    top-k of them, `scoring`'s) and the sinks, one softmax; while training, the indexer's loss attached."""
    selected = None if scoring is None else parts.indexer.top_k(scoring, parts.topk, stable=True)
    outs, probs = [], []
    for a, b, first, keys, docs in runs:
        picks = None if entries is None else Entries(entries, parts.rate, entry_docs,
                                                     None if selected is None else selected[:, a:b])
        out = parts.sdpa(q[:, :, a:b], keys, keys, docs, entries=picks, k_first=first)
        if selected is not None:
            out, p = out
            probs.append(p)
        outs.append(out)
    out = torch.cat(outs, dim=2)
    if scoring is not None and training and parts.loss.weight:
        target = parts.head_sum(torch.cat(probs, dim=1), summed=True)
        out = parts.loss.attach(out, parts.indexer.kl(scoring, target, selected))
    return out


class CompressedCore(nn.Module):
    """V4's attention on this rank's whole sequence (`attend`: the window, the entries its compressor makes, CSA's
    top-k, the sink). Parameterless (its block's modules come in `parts`), so context parallelism swaps it for one
    whose sequence spans the ranks (tessera.parallel.cp.ContextParallelCompressed), which takes its `attend`."""

    def forward(self, parts: Parts, x: torch.Tensor, q_latent: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                rope: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """x [batch, seq, dim] and its query bottleneck `q_latent`; q [batch, heads, seq, dim], kv [batch, 1, seq,
        dim] (keys that are their values), `rope` the tokens' rows, `documents` [batch, seq] -> [batch, heads,
        seq, dim]."""
        entries = entry_docs = scoring = None
        if parts.compressor is not None:
            entries = parts.compressor(x, rope, documents)
            entry_docs = None if documents is None else entry_documents(documents, parts.rate, entries.shape[1])
        if parts.indexer is not None:  # its inputs detached: its only signal is its own loss
            scoring = parts.indexer(x.detach(), q_latent.detach(), rope, documents)
        return self.attend(parts, q, [(0, q.shape[2], 0, kv, documents)], entries, entry_docs, scoring, self.training)

    attend = staticmethod(attend)


class V4Attention(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        a = args
        self.head_dim, self.eps = a.head_dim, a.norm_eps
        self.rate, self.topk = a.rate(layer_id), a.index_topk
        self.compressed = self.rate > 0  # its RoPE is the compressed blocks' table
        self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(a.q_lora_rank, eps=a.norm_eps)
        self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * a.head_dim, bias=False)
        self.kv = SharedKV(a.dim, a.head_dim, a.norm_eps)
        self.sdpa = CausalSDPA(window=a.window, n_sinks=a.n_heads, scale=a.head_dim ** -0.5)
        self.wo_a = GroupedLinear(a.n_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank, a.o_groups)
        self.wo_b = nn.Linear(a.o_groups * a.o_lora_rank, a.dim, bias=False)
        csa = a.layer_types[layer_id] == CSA
        self.compressor = Compressor(a.dim, a.head_dim, self.rate, csa, a.norm_eps) if self.rate else None
        self.indexer = Indexer(a) if csa else None
        if csa:  # its loss: KL to the heads' attention over the entries it picked (DeepSeek V3.2's, sparse)
            self.indexer_loss = SideLoss("indexer_loss", "deepseek_v4.indexer_loss_weight")
            self.head_sum = sparse.HeadSum()
        self.compressed_core = CompressedCore()  # its attention's steps, which context parallelism swaps

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, dim]; `rope`: both tables' rows [.., 2 tables, 2, rope dim] (sliding's, compressed's).
        `cache`: the block's earlier inputs (decoding recomputes them, returning the new positions' outputs)."""
        new = x.shape[1]
        if cache is not None:
            x = cache.extend(x)
        seq = x.shape[1]
        rope = rope[..., int(self.compressed), :, :]
        rope = rope[:seq] if rope.dim() == 3 else rope
        q_latent = self.q_norm(self.wq_a(x))
        q = unweighted_rms(self.wq_b(q_latent).unflatten(-1, (-1, self.head_dim)), self.eps)
        q = rope_tail(q, rope)
        kv = rope_tail(self.kv(x).unsqueeze(2), rope).squeeze(2)
        if documents is not None and cache is not None:
            raise ValueError("decoding packed documents is not supported")
        parts = Parts(self.compressor, self.indexer, self.sdpa, getattr(self, "head_sum", None),
                      getattr(self, "indexer_loss", None), self.rate, self.topk)
        out = self.compressed_core(parts, x, q_latent, q.transpose(1, 2), kv.unsqueeze(1), rope, documents)
        out = rope_tail(out.transpose(1, 2)[:, -new:], rope[..., -new:, :, :], inverse=True)
        return self.wo_b(self.wo_a(out.flatten(2)))
