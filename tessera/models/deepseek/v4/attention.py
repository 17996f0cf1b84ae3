"""DeepSeek V4's attention: one key/value head that every query head shares (keys are values), a learned sink per
head, a sliding window over the uncompressed keys, and in compressed blocks entries that each compress several
tokens: all of them (HCA) or those a lightning indexer ranks highest for each query (CSA).

RoPE turns each head's trailing `rope_head_dim` dims in pairs; since values are keys, the output's trailing dims
are turned back by the query's angle (so each value enters at its distance from the query). The output projection
is grouped: heads in `o_groups` groups, each projected to `o_lora_rank`, then mixed to the model's width.

CSA's indexer learns as DeepSeek V3.2's (tessera/models/deepseek/dsa.py), sparse: its scores, softmaxed over the
entries it picked, fitted by KL to the heads' summed attention probabilities over them; its inputs detached.

Computed as a reference path on any device: the window's scores a block of `window` queries at a time (2 x window
keys each), the compressed entries' scores materialized [queries, entries] (1 / rate of dense attention's), one
softmax over both and the sink. Packed documents: a query sees no key before its document's start, and no entry
whose window starts before it; CSA's reach back stops at a document's start. A document that starts on a multiple
of the rates gets the entries it gets alone."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.common.side_loss import SideLoss
from tessera.models.deepseek import dsa
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


class Indexer(nn.Module):
    """CSA's lightning indexer: its own compressor (index_head_dim) over the same windows, queries from the query's
    bottleneck; I[t, s] = sum_h w[t, h] / sqrt(H) * relu(q[t, h] . k[s] / sqrt(d))."""

    def __init__(self, args):
        super().__init__()
        self.heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.compressor = Compressor(args.dim, args.index_head_dim, args.csa_rate, True, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, args.index_n_heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [batch, seq, entries] in fp32."""
        bsz, seq, _ = x.shape
        keys = self.compressor(x, rope, documents)
        q = rope_tail(self.wq_b(q_latent).view(bsz, seq, self.heads, self.head_dim), rope)
        scores = F.relu(torch.einsum("bshd,btd->bsht", q.float(), keys.float())) * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.heads ** -0.5
        return torch.einsum("bsht,bsh->bst", scores, weights)


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


class SinkAttention(nn.Module):
    """The attention itself, holding a sink logit per head (a module of its own: under TP each rank keeps its
    heads')."""

    def __init__(self, heads: int, window: int, scale: float):
        super().__init__()
        self.window, self.scale = window, scale
        self.sinks = nn.Parameter(torch.empty(heads))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, keys_allowed, entries: torch.Tensor | None,
                entries_allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return window_attention(q, kv, self.window, keys_allowed, entries, entries_allowed, local(self.sinks),
                                self.scale)


def window_attention(q: torch.Tensor, kv: torch.Tensor, window: int, keys_allowed, entries: torch.Tensor | None,
                     entries_allowed: torch.Tensor | None, sinks: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [batch, seq, heads, dim], kv [batch, seq, dim]: each query over its window's keys (and, allowed,
    `entries` [batch, n, dim]) and its head's sink, one softmax; (the output [batch, seq, heads, dim], the
    entries' probabilities [batch, heads, seq, n] or None). `keys_allowed`: (query, key) -> bool on index tensors
    of any shape (documents), None: all in the window."""
    bsz, seq, heads, dim = q.shape
    blocks = -(-seq // window)
    pad = blocks * window - seq
    qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(bsz, blocks, window, heads, dim)
    kvb = F.pad(kv, (0, 0, window, pad)).unfold(1, 2 * window, window).transpose(-1, -2)  # [b, blocks, 2w, d]
    t = torch.arange(blocks * window, device=q.device).view(blocks, window, 1)
    s = (torch.arange(blocks, device=q.device).view(blocks, 1, 1) - 1) * window + torch.arange(2 * window,
                                                                                                device=q.device)
    near = (t - s >= 0) & (t - s < window) & (s >= 0)  # [blocks, w, 2w]
    allowed = near if keys_allowed is None else near & keys_allowed(t.clamp(max=seq - 1), s.clamp(0, seq - 1))
    logits = [torch.einsum("bnqhd,bnkd->bnhqk", qb, kvb).float() * scale]
    masks = [allowed.unsqueeze(-3)]
    if entries is not None:
        ec = torch.einsum("bshd,btd->bhst", F.pad(q, (0, 0, 0, 0, 0, pad)), entries).float() * scale
        logits.append(ec.unflatten(2, (blocks, window)).transpose(1, 2))  # [b, blocks, heads, w, n]
        em = F.pad(entries_allowed, (0, 0, 0, pad)).unflatten(1, (blocks, window))  # [b, blocks, w, n]
        masks.append(em.unsqueeze(-3))
    logits = [x.masked_fill(~m, float("-inf")) for x, m in zip(logits, masks, strict=True)]
    sink = sinks.float().view(1, 1, heads, 1, 1).expand(bsz, blocks, heads, window, 1)
    probs = torch.cat([*logits, sink], dim=-1).softmax(dim=-1).to(q.dtype)
    out = torch.einsum("bnhqk,bnkd->bnqhd", probs[..., :2 * window], kvb)
    if entries is None:
        return out.flatten(1, 2)[:, :seq], None
    entry_probs = probs[..., 2 * window:-1]
    out = out + torch.einsum("bnhqt,btd->bnqhd", entry_probs, entries)
    return out.flatten(1, 2)[:, :seq], entry_probs.transpose(1, 2).flatten(2, 3)[:, :, :seq]


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
        self.core = SinkAttention(a.n_heads, a.window, a.head_dim ** -0.5)
        self.wo_a = GroupedLinear(a.n_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank, a.o_groups)
        self.wo_b = nn.Linear(a.o_groups * a.o_lora_rank, a.dim, bias=False)
        csa = a.layer_types[layer_id] == CSA
        self.compressor = Compressor(a.dim, a.head_dim, self.rate, csa, a.norm_eps) if self.rate else None
        self.indexer = Indexer(a) if csa else None
        if csa:  # its loss: KL to the heads' attention over the entries it picked (DeepSeek V3.2's, sparse)
            self.indexer_loss = SideLoss("indexer_loss", "deepseek_v4.indexer_loss_weight")
            self.head_sum = dsa.HeadSum()

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
        same_doc = None
        if documents is not None:
            if cache is not None:
                raise ValueError("decoding packed documents is not supported")
            same_doc = lambda t, s: documents[:, t] == documents[:, s]  # noqa: E731
        entries = allowed = scores = None
        if self.compressor is not None:
            entries = self.compressor(x, rope, documents)
            allowed = self._entries_allowed(seq, len(entries[0]), documents, x.device)
            if self.indexer is not None:  # its inputs detached: its only signal is its own loss
                scores = self.indexer(x.detach(), q_latent.detach(), rope, documents)
                allowed = dsa.selected(scores, allowed.expand_as(scores), self.topk, stable=True)
            else:
                allowed = allowed.expand(x.shape[0], -1, -1)
        out, entry_probs = self.core(q, kv, same_doc, entries, allowed)
        out = rope_tail(out[:, -new:], rope[..., -new:, :, :], inverse=True)
        out = self.wo_b(self.wo_a(out.flatten(2)))
        if scores is not None and self.training and self.indexer_loss.weight:
            out = self.indexer_loss.attach(out, dsa.indexer_kl(self.head_sum(entry_probs.detach()), scores, allowed))
        return out

    def _entries_allowed(self, seq: int, n: int, documents: torch.Tensor | None, device) -> torch.Tensor:
        """[1 or batch, seq, n]: entry w is query t's once its window has passed ((w + 1) rate <= t + 1) and, with
        documents, when its window starts in t's document (so it holds no token before it: see Compressor)."""
        t = torch.arange(seq, device=device).view(-1, 1)
        w = torch.arange(n, device=device)
        allowed = ((w + 1) * self.rate <= t + 1).unsqueeze(0)
        if documents is None:
            return allowed
        return allowed & (documents[:, w * self.rate].unsqueeze(1) == documents.unsqueeze(-1))
