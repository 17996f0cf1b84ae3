"""Context parallelism on plain collectives, so it runs on gloo (CPU) and NCCL alike.

Each CP rank holds two of 2·CP equal chunks of every sequence: chunk r and chunk 2·CP−1−r. Under causal
attention late chunks attend to more keys than early ones, so pairing them balances the work. Attention
all-gathers K and V over the CP group and each local query chunk attends to the keys at or before it;
autograd carries the gradients of K and V back to their owners. The kernel is the replaced one's: on CUDA
FlexAttention, elsewhere the blockwise kernel; neither keeps scores, so a rank keeps its chunks' activations and
the gathered keys and values, linear in the sequence.

Ulysses (parallelism.context_parallel_method = ulysses) swaps the sequence split for a head split around
attention instead. Outside attention each rank still holds its two chunks. Before attention one all-to-all over
the CP group sends each rank's queries, keys and values of head group g to rank g: every rank then holds whole
sequences (in global order) of heads / CP heads, and the replaced kernel's own `attend` runs on them unchanged,
with its masks (causal, windows, chunks, documents) and its sinks (this rank's heads' share). A second all-to-all
sends the outputs back to the ranks that own their tokens. Each rank sends (CP−1)/CP of its own q, k, v and
output, whatever CP, where all-gather CP receives every other rank's keys and values. The all-to-all is torch's
functional, differentiable one (its backward is the same exchange), which compiles and runs on gloo and NCCL.
Key/value heads that do not divide by CP are repeated (each lcm(kv heads, CP) / kv heads times) so that every
rank gets the key heads its query heads read. A linear-attention layer (Gated DeltaNet) takes the same head split
around its per-head recurrence (UlyssesHeads): each rank runs it along whole sequences of its head group, exactly.
"""

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp)], dim=dim)


def _in_order(parts, cp: int, dim: int) -> torch.Tensor:
    """Each rank's two chunks (`parts[rank]`, 2L long along `dim`) -> the whole sequence along `dim`."""
    ordered = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        head, tail = chunk_ids(rank, cp)
        ordered[head], ordered[tail] = part.chunk(2, dim=dim)
    return torch.cat(ordered, dim=dim)


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Every rank's two chunks (shard_sequence's) -> the whole sequence along `dim`, on every rank (no gradient)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return _in_order(parts, len(parts), dim)


class _AllGather(torch.autograd.Function):
    """[...] on each rank -> [ranks, ...]; backward sums each rank's gradient for every piece back to its owner.
    (torch.distributed.nn's version mis-addresses sub-groups on gloo.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group), *x.shape))
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)  # gloo lacks all_gather_into_tensor
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":  # no reduce-scatter there: exchange, then sum
            pieces = torch.empty_like(grad)
            dist.all_to_all_single(pieces, grad, group=ctx.group)
            return pieces.sum(0), None
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class WholeDocuments:
    """The whole sequence's document numbers [batch, 2·CP·L] from each rank's [batch, 2L], gathered in global
    order over the CP group. The CP layers of a model share one (apply_cp): every layer of an eager forward asks
    with the same tensor, so the first gathers and the others read what it kept (the last forward's, held until
    the next). Compiled blocks (compiled whole-graph) gather their own, traced: [batch, 2L] integers, small beside
    attention's all-to-alls."""

    def __init__(self, group: dist.ProcessGroup, cp: int):
        self.group, self.cp = group, cp
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (local document numbers, the whole sequence's)

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _gather_documents(local, self.group, self.cp)
        if self.last is None or self.last[0] is not local:
            self.last = local, _gather_documents(local, self.group, self.cp)
        return self.last[1]


def _gather_documents(local: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """An all-to-all that sends every rank the same piece is an all-gather (gloo lacks all_gather_into_tensor);
    torch's functional one traces under compile."""
    parts = funcol.all_to_all_single(local.expand(cp, *local.shape).contiguous(), None, None, group)
    return _in_order(parts.unbind(0), cp, dim=1)


class ContextParallelAttention(nn.Module):
    """This rank's query chunks against the whole sequence's keys and values, with the mask (causal, narrowed
    by a window or chunks) and the sinks of the kernel it replaces (the same parameter, under the same name),
    computed by that kernel's own `attend` function (queries at the last positions of the keys it is given)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, kernel: nn.Module,
                 documents: WholeDocuments):
        super().__init__()
        self.group, self.cp_rank, self.cp, self.documents = group, cp_rank, cp, documents
        self.scale, self.window, self.chunk = (getattr(kernel, a, None) for a in ("scale", "window", "chunk"))
        self.sinks, self.masks = getattr(kernel, "sinks", None), getattr(kernel, "masks", None)
        self.attend = kernel.attend

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h, 2L, d] on each rank -> [b, h, 2·CP·L, d] in global order."""
        return _in_order(_AllGather.apply(x, self.group), self.cp, dim=2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` [batch, 2L]: the document numbers of this rank's tokens (numbered over the whole sequence);
        the keys' are gathered here."""
        keys, values = self._whole(k), self._whole(v)
        docs = None if documents is None else self.documents(documents)
        size = q.shape[2] // 2
        out = []
        for half, chunk in enumerate(chunk_ids(self.cp_rank, self.cp)):
            end = (chunk + 1) * size  # keys after the chunk's last query are all masked: skip them
            out.append(self.attend(q[:, :, half * size:(half + 1) * size], keys[:, :, :end], values[:, :, :end],
                                   self.window, self.chunk, self.scale, self.sinks,
                                   None if docs is None else docs[:, :end], self.masks))
        return torch.cat(out, dim=2)


class ContextParallelSparse(nn.Module):
    """DeepSeek V3.2's sparse attention (DSA; GLM-5's) under all-gather CP, in place of the block's sparse core
    (tessera.models.deepseek.dsa.SparseCore): this rank's queries, its two chunks, select among every earlier key of
    the whole sequence. What is gathered over the CP group is what is small per token: the attention's keys and
    values as the block hands them (MLA's latent and RoPE key, one head shared by all query heads, when it attends
    in the latent), the indexer's one-head keys and the documents; the top-k, the attention over the selected keys
    (every key in the dense warm-up, each chunk against the keys up to its end) and the indexer's loss then run as on
    one rank (the core's `attend`), the gradients of the gathered keys going back to their owners."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, core: nn.Module, documents: WholeDocuments):
        super().__init__()
        self.group, self.cp_rank, self.cp, self.documents = group, cp_rank, cp, documents
        self.attend = core.attend  # the steps the replaced core runs after its keys are in hand

    def _whole(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _in_order(_AllGather.apply(x, self.group), self.cp, dim=dim)

    def forward(self, parts, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, cache=None, documents: torch.Tensor | None = None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("context parallel: decoding with a cache runs without context parallelism")
        if self.training:
            x, q_latent = x.detach(), q_latent.detach()
        size = q.shape[2] // 2  # this rank's two chunks: (first query, end, position of the first)
        spans = tuple((i * size, (i + 1) * size, c * size) for i, c in enumerate(chunk_ids(self.cp_rank, self.cp)))
        keys = self._whole(k, 2)
        values = keys if v is k else self._whole(v, 2)
        docs = None if documents is None else self.documents(documents)
        scoring = None
        if parts.indexer is not None:
            scoring, _ = parts.indexer(x, q_latent, rope)
            scoring = dataclasses.replace(scoring, k=self._whole(scoring.k, 1), spans=spans, q_documents=documents,
                                          k_documents=docs)
        return self.attend(parts, scoring, q, keys, values, docs, spans, self.training)


class ContextParallelCompressed(nn.Module):
    """DeepSeek V4's attention under all-gather CP, in place of its block's core (its CompressedCore): this rank's
    two chunks of queries each read the window's keys over their chunk and the window - 1 before it (the end of the
    chunk before, gathered), the compressed entries of the whole sequence (each rank compresses its chunks' windows,
    CSA's overlap reading the last window of the chunk before; the entries gathered) and, in CSA blocks, the
    indexer's top-k of them (its entry keys made and gathered alike); then the core's `attend` runs over the two
    runs of positions. Chunks hold whole windows of the compression rate and at least the attention's window
    (checked before launch)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, core: nn.Module, documents: WholeDocuments):
        super().__init__()
        self.group, self.cp_rank, self.cp, self.documents = group, cp_rank, cp, documents
        self.attend = core.attend  # the steps the replaced core runs once its keys and entries are in hand

    def forward(self, parts, x: torch.Tensor, q_latent: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                rope: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        half, chunks = q.shape[2] // 2, chunk_ids(self.cp_rank, self.cp)
        docs = None if documents is None else self.documents(documents)  # the whole sequence's
        back = parts.sdpa.window - 1
        tails = _AllGather.apply(torch.stack([kv[:, :, (i + 1) * half - back:(i + 1) * half] for i in (0, 1)]),
                                 self.group) if back > 0 else None  # [CP, 2, b, 1, back, d]
        runs = []
        for i, c in enumerate(chunks):  # (first query, end, first key's position, keys, their documents)
            keys, first = kv[:, :, i * half:(i + 1) * half], c * half
            if c and tails is not None:
                keys, first = torch.cat([tails[_owner(c - 1, self.cp)], keys], dim=2), first - back
            runs.append((i * half, (i + 1) * half, first, keys,
                         None if docs is None else docs[:, first:(c + 1) * half]))
        entries = entry_docs = scoring = None
        if parts.compressor is not None:
            entries = self._entries(parts.compressor, x, rope, docs)
            entry_docs = None if docs is None else docs[:, :entries.shape[1] * parts.rate:parts.rate]
        if parts.indexer is not None:  # its inputs detached: its only signal is its own loss
            x, q_latent = x.detach(), q_latent.detach()
            keys = self._entries(parts.indexer.compressor, x, rope, docs)
            spans = tuple((i * half, (i + 1) * half, c * half) for i, c in enumerate(chunks))
            scoring = dataclasses.replace(parts.indexer(x, q_latent, rope, documents, keys, entry_docs), spans=spans)
        return self.attend(parts, q, runs, entries, entry_docs, scoring, self.training)

    def _entries(self, compressor: nn.Module, x: torch.Tensor, rope: torch.Tensor,
                 docs: torch.Tensor | None) -> torch.Tensor:
        """The whole sequence's entries [b, n, d]: each of this rank's chunks compressed here, then gathered in
        order. CSA's overlap reads the window before a chunk's first: that window's tokens (the end of the chunk
        before, gathered) lead the chunk into the compressor, and the entry they make is dropped (the RoPE rows
        they take are the chunk's: only that entry reads them)."""
        half, rate, chunks = x.shape[1] // 2, compressor.rate, chunk_ids(self.cp_rank, self.cp)
        halo = None  # the last window of each chunk [CP, 2, b, rate, dim]
        if compressor.overlap:
            halo = _AllGather.apply(torch.stack([x[:, (i + 1) * half - rate:(i + 1) * half] for i in (0, 1)]),
                                    self.group)
        local = []
        for i, c in enumerate(chunks):
            xs, rows = x[:, i * half:(i + 1) * half], rope[:, i * half:(i + 1) * half]
            start = c * half - (rate if halo is not None and c else 0)
            if start < c * half:
                xs, rows = torch.cat([halo[_owner(c - 1, self.cp)], xs], dim=1), torch.cat([rows[:, :rate], rows], 1)
            entries = compressor(xs, rows, None if docs is None else docs[:, start:(c + 1) * half])
            local.append(entries[:, 1:] if start < c * half else entries)
        return _in_order(_AllGather.apply(torch.cat(local, dim=1), self.group), self.cp, dim=1)


class BidirectionalContextParallelAttention(nn.Module):
    """For a kernel with `bidirectional = True` (no mask: a diffusion transformer's joint attention): this rank's
    queries against every rank's keys and values. Without a mask the keys' order is moot, so they are taken as
    gathered; the kernel's own `attend(q, k, v)` computes it."""

    def __init__(self, group: dist.ProcessGroup, kernel: nn.Module):
        super().__init__()
        self.group, self.attend = group, kernel.attend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = (_AllGather.apply(x, self.group).permute(1, 2, 0, 3, 4).flatten(2, 3) for x in (k, v))
        return self.attend(q, keys, values)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[CP, ...] on each rank: piece j to rank j; piece i of the result is rank i's."""
    return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)


def heads_to_sequence_split(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[b, h, 2L, d] (this rank's chunks, all its heads) -> [b, h / CP, 2·CP·L, d] (the whole sequence in
    global order, this rank's head group)."""
    b, h, n, d = x.shape
    parts = _exchange(x.view(b, cp, h // cp, n, d).transpose(0, 1), group)  # [CP (sender), b, h / CP, 2L, d]
    return _in_order(parts.unbind(0), cp, dim=2)


def sequence_to_heads_split(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """The inverse: [b, h / CP, 2·CP·L, d] -> [b, h, 2L, d]."""
    parts = torch.stack([shard_sequence(x, rank, cp, dim=2) for rank in range(cp)])  # [CP (receiver), ...]
    return _exchange(parts, group).transpose(0, 1).flatten(1, 2)  # [b, CP (head group) x h / CP, 2L, d]


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so that CP divides them: 1 when it already does."""
    return math.lcm(kv_heads, cp) // kv_heads


class UlyssesAttention(nn.Module):
    """The kernel it replaces (its `attend`, masks, scale and sinks: the same parameter, under the same name),
    run on whole sequences of this rank's head group."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, kernel: nn.Module,
                 documents: WholeDocuments):
        super().__init__()
        self.group, self.cp_rank, self.cp, self.documents = group, cp_rank, cp, documents
        self.bidirectional = getattr(kernel, "bidirectional", False)
        self.scale, self.window, self.chunk = (getattr(kernel, a, None) for a in ("scale", "window", "chunk"))
        self.sinks, self.masks = getattr(kernel, "sinks", None), getattr(kernel, "masks", None)
        self.attend = kernel.attend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v [batch, heads, 2L, head_dim] of this rank's tokens; `documents` [batch, 2L]: their document
        numbers (numbered over the whole sequence)."""
        if q.shape[1] % self.cp:
            raise ValueError(f"Ulysses context parallel: {q.shape[1]} query heads per rank do not divide by "
                             f"CP {self.cp}")
        repeats = kv_repeats(k.shape[1], self.cp)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        q, k, v = (heads_to_sequence_split(x, self.group, self.cp) for x in (q, k, v))
        if self.bidirectional:
            out = self.attend(q, k, v)
        else:
            docs = None if documents is None else self.documents(documents)
            out = self.attend(q, k, v, self.window, self.chunk, self.scale, self._my_sinks(), docs, self.masks)
        return sequence_to_heads_split(out, self.group, self.cp)

    def _my_sinks(self) -> torch.Tensor | None:
        if self.sinks is None:
            return None
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks  # TP: this rank's heads
        share = sinks.shape[0] // self.cp
        return sinks[self.cp_rank * share:(self.cp_rank + 1) * share]


class UlyssesHeads(nn.Module):
    """Ulysses for a per-head sequence mixer without attention's q, k, v (a linear-attention layer's recurrence,
    Gated DeltaNet's: tessera.models.common.deltanet.DeltaRule), which needs each head's whole sequence: one
    all-to-all sends the group-g slice of every per-token input (split by head along its last dim) to rank g, which
    runs the `rule` it replaces on whole sequences of its head group with those heads' parameters (rows of the
    per-head parameters, split along their first dim) and the whole sequence's document numbers; a second sends the
    outputs [batch, 2·CP·L, heads / CP, ...] back to the ranks that own their tokens."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, rule: nn.Module, documents: WholeDocuments):
        super().__init__()
        self.group, self.cp_rank, self.cp, self.rule, self.documents = group, cp_rank, cp, rule, documents

    def forward(self, inputs: list[torch.Tensor], heads: list[torch.Tensor], documents: torch.Tensor | None = None,
                cache=None, **settings) -> torch.Tensor:
        if cache is not None:
            raise ValueError("Ulysses context parallel: decoding with a cache runs without context parallelism")
        sizes = [x.shape[-1] // self.cp for x in inputs]
        grouped = torch.cat([x.unflatten(-1, (self.cp, -1)) for x in inputs], dim=-1)  # [b, 2L, CP, group's]
        parts = _exchange(grouped.movedim(2, 0), self.group)  # [CP (sender), b, 2L, group's]
        whole = _in_order(parts.unbind(0), self.cp, dim=1).split(sizes, dim=-1)
        mine = [p.chunk(self.cp)[self.cp_rank] for p in heads]
        docs = None if documents is None else self.documents(documents)
        out = self.rule(list(whole), mine, docs, **settings)  # [b, 2·CP·L, heads / CP, ...]
        back = torch.stack([shard_sequence(out, rank, self.cp) for rank in range(self.cp)])  # [CP (receiver), ...]
        return _exchange(back, self.group).movedim(0, 2).flatten(2, 3)  # [b, 2L, CP (head group) x heads / CP, ...]


def _owner(chunk: int, cp: int) -> tuple[int, int]:
    """(rank, its piece 0 or 1) holding chunk `chunk` of 2 CP."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


class StatePassing(nn.Module):
    """A DeltaNet layer's `rule` (tessera.models.common.deltanet.DeltaRule) under all-gather CP, by state passing:
    each rank runs the delta rule on its own two chunks of the sequence (chunks r and 2 CP - 1 - r of 2 CP,
    shard_sequence's), and the state each chunk starts from comes from the chunks before it, so the CP degree is
    not bounded by the heads (Ulysses' is) and no per-token all-to-all is needed.

    The delta rule is linear in its initial state: a chunk maps the state S it starts from to A S + B, and its
    outputs to O0 + Q S. One pass over a chunk with an extra block of value columns gives all of them: values
    [v | 0] from the initial state [0 | I] end in [B | A] with outputs [O0 | Q]. The ranks all-gather their chunks'
    (A, B) (per value head [dk, dk + dv], whatever the length), each composes the chunks before its own into the
    state it starts from (zero where a document starts) and adds Q S to its outputs; gradients reach the earlier
    chunks through the all-gather. The short causal convolution before the rule reads the last K - 1 inputs of the
    chunk before (gathered too). Computed with the chunked torch form (not fla's kernels)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, rule: nn.Module, documents: WholeDocuments):
        super().__init__()
        self.group, self.cp_rank, self.cp, self.rule, self.documents = group, cp_rank, cp, rule, documents

    def forward(self, inputs: list[torch.Tensor], heads: list[torch.Tensor], documents: torch.Tensor | None = None,
                cache=None, chunk_size: int = 64, fla: bool = False) -> torch.Tensor:
        if cache is not None:
            raise ValueError("context parallel (state passing): decoding with a cache runs without context "
                             "parallelism")
        q, k, v, a, b = inputs
        *taps, a_log, dt_bias = heads
        qkv, weight, sizes = torch.cat([q, k, v], dim=-1), torch.cat(taps), [len(t) for t in taps]
        back, half = weight.shape[1] - 1, qkv.shape[1] // 2
        whole = None if documents is None else self.documents(documents)  # [batch, 2 CP L]
        # the K - 1 convolution inputs before each chunk: the end of the chunk before it, wherever it is
        tails = _AllGather.apply(torch.stack([qkv[:, half - back:half], qkv[:, 2 * half - back:]]), self.group)
        pieces, ends = [], []
        for i, chunk in enumerate(chunk_ids(self.cp_rank, self.cp)):
            part = slice(i * half, (i + 1) * half)
            halo = tails[_owner(chunk - 1, self.cp)] if chunk else qkv.new_zeros(qkv.shape[0], back, qkv.shape[2])
            docs = None if whole is None else whole[:, max(chunk * half - back, 0):(chunk + 1) * half]
            if docs is not None and not chunk:  # nothing before the sequence: its own document number, unlike any
                docs = torch.cat([docs.new_full((docs.shape[0], back), -1), docs], dim=1)
            conv = self.rule.conv(torch.cat([halo, qkv[:, part]], dim=1), weight, docs)[:, back:]
            qs, ks, vs, g, beta = self.rule.gates(conv, sizes, a[:, part], b[:, part], a_log, dt_bias)
            dk, dv, heads_ = ks.shape[-1], vs.shape[-1], ks.shape[2]
            eye = torch.eye(dk, device=qs.device).expand(qs.shape[0], heads_, dk, dk)
            start = torch.cat([eye.new_zeros(*eye.shape[:-1], dv), eye], dim=-1)  # [0 | I]
            values = torch.cat([vs.float(), vs.new_zeros(*vs.shape[:-1], dk).float()], dim=-1)  # [v | 0]
            out, end = self.rule.chunked(qs, ks, values, g, beta, chunk_size, start,
                                            None if whole is None else docs[:, back:], self.rule.scan)
            pieces.append(out)
            ends.append(end)  # [batch, heads, dk, dv + dk] = [B | A]
        every = _AllGather.apply(torch.stack(ends), self.group)  # [CP, 2, batch, heads, dk, dv + dk]
        outs = []
        for chunk, out in zip(chunk_ids(self.cp_rank, self.cp), pieces, strict=True):
            state = out.new_zeros(*every.shape[2:-1], dv)
            for before in range(chunk + 1):  # the chunks before this one, in order, then its own start
                if whole is not None and before:  # a document starting with a chunk starts from nothing (its map
                    fresh = whole[:, before * half] != whole[:, before * half - 1]  # reads what came before)
                    state = state * (~fresh).to(state.dtype)[:, None, None, None]
                if before < chunk:
                    end = every[_owner(before, self.cp)]
                    state = end[..., dv:] @ state + end[..., :dv]
            reads = out[..., dv:].transpose(1, 2) @ state  # [batch, heads, seq, dv]
            outs.append(out[..., :dv] + reads.transpose(1, 2).to(out.dtype))
        return torch.cat(outs, dim=1).to(v.dtype)


def apply_cp(blocks: dict[str, nn.Module], attention: str, cp_mesh: DeviceMesh, method: str = "allgather") -> None:
    """Swap each block's attention kernel (`<attention>.sdpa`) for the context-parallel one of `method`
    (parallelism.context_parallel_method); a linear-attention mixer's per-head recurrence (`<attention>.rule`) runs
    Ulysses (whole sequences of a head group per rank) or, under all-gather CP, by state passing (each rank its
    chunks, the state they start from composed from the chunks before: StatePassing). The blocks share one
    gathering of the document numbers per forward."""

    group, rank, cp = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    documents = WholeDocuments(group, cp)
    for block in blocks.values():
        module = getattr(block, attention)
        if method == "allgather" and hasattr(module, "sparse_core"):  # DSA: its keys span the ranks
            module.sparse_core = ContextParallelSparse(group, rank, cp, module.sparse_core, documents)
            continue
        if method == "allgather" and hasattr(module, "compressed_core"):  # DeepSeek V4: windows, entries
            module.compressed_core = ContextParallelCompressed(group, rank, cp, module.compressed_core, documents)
            continue
        if hasattr(module, "rule"):
            wrap = UlyssesHeads if method == "ulysses" else StatePassing
            module.rule = wrap(group, rank, cp, module.rule, documents)
            continue
        if method == "ulysses":
            module.sdpa = UlyssesAttention(group, rank, cp, module.sdpa, documents)
            continue
        if getattr(module.sdpa, "bidirectional", False):
            module.sdpa = BidirectionalContextParallelAttention(group, module.sdpa)
            continue
        module.sdpa = ContextParallelAttention(group, rank, cp, module.sdpa, documents)


class SplitLookahead(nn.Module):
    """A model's lookahead (tessera.models.common.side_loss.Lookahead: the tokens after each position, for
    multi-token prediction) on ranks that hold different tokens of a micro-batch: data-parallel ranks, CP's chunks.
    Trained labels are counted over all of them (`counted`, `ranks` of them), per rank (gradients are averaged over
    them), so that a loss divided by the count is the whole micro-batch's mean, as one process computes it, also
    where the ranks' labels are trained unevenly (packed documents: a document's first targets are not). Under CP
    (`cp`, its mesh) this rank's chunks of the whole sequence's shift, which reads across chunk boundaries: ids,
    positions, documents and labels are small, each gathered whole, shifted, and cut again."""

    def __init__(self, plain: nn.Module, counted: dist.ProcessGroup, ranks: int, cp: DeviceMesh | None = None):
        super().__init__()
        self.counted, self.ranks = counted, ranks
        self.group, self.cp_rank, self.cp = (cp.get_group(), cp.get_local_rank(), cp.size()) if cp else (None, 0, 1)
        self.shift, self.count = type(plain).shift, type(plain).count

    @torch.compiler.disable
    def ahead(self, x: torch.Tensor, k: int, fill: int | None = None, end: int = 0) -> torch.Tensor:
        if self.cp == 1:
            return self.shift(x, k, fill, end)
        parts = [torch.empty_like(x) for _ in range(self.cp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        whole = _in_order(parts, self.cp, dim=-1)
        return shard_sequence(self.shift(whole, k, fill, end), self.cp_rank, self.cp, dim=-1)

    @torch.compiler.disable
    def trained(self, labels: torch.Tensor) -> torch.Tensor:
        total = self.count(labels)
        dist.all_reduce(total, group=self.counted)
        return total.clamp(min=1) / self.ranks
