"""The output head and the token cross-entropy, a chunk of tokens at a time (`training.loss_chunks`), so the whole
`[tokens, vocab]` logits (and their fp32 copy) never exist: each chunk's logits are made, reduced to a summed loss
and freed; backward recomputes them chunk by chunk (an activation checkpoint per chunk), so only one chunk's
logits and their gradient are ever alive. The price is one more head matmul per chunk in backward.

Under TP the normed hidden states are gathered over the sequence once (they are `dim` wide, the logits `vocab`
wide); each chunk's logits are then vocab-sharded under loss parallel (the cross-entropy reduces them in place)
or gathered. Under CP and PP each rank's tokens are its own: the chunks are of those."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum (not the mean) of the token cross-entropies, in fp32, over the trained tokens (labels -100 are
    not): chunks' sums add up to the whole's, and the trainer divides by the step's trained tokens."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum")


def _chunk(head: Callable, loss: Callable, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return loss(head(hidden), labels)


def chunked_cross_entropy(head: Callable, hidden: torch.Tensor, labels: torch.Tensor, chunks: int,
                          loss: Callable = summed_cross_entropy) -> torch.Tensor:
    """The summed token cross-entropy of `head(hidden)` [batch, seq, vocab] against `labels` [batch, seq], computed
    over `chunks` slices of the sequence one at a time (recomputed in backward when grad is on). `loss`: a summed
    cross-entropy of (logits, labels) (the compiled one under compile.components "loss")."""
    if isinstance(hidden, DTensor):  # sequence-parallel under TP: gathered once, then sliced locally
        hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)
    total = None
    for h, y in zip(hidden.chunk(chunks, dim=1), labels.chunk(chunks, dim=1), strict=True):
        if torch.is_grad_enabled():
            part = checkpoint(_chunk, head, loss, h, y, use_reentrant=False)
        else:
            part = _chunk(head, loss, h, y)
        total = part if total is None else total + part
    return total
