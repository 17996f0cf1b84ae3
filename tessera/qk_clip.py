"""QK-clip, MuonClip's second half (the Kimi K2 report): after each optimizer step, every attention head whose
largest attention logit of the step, S, exceeded `optimizer.qk_clip_threshold` t gets its query and key
projections scaled so that the same inputs would give logits times gamma = t / S (at most t). A family says how
(its `Family.qk_clip`): per head, segments of a projection's output rows and the power of gamma each takes. MLA's:
the query's and the keys' parts without RoPE by sqrt(gamma) each, the query's RoPE part by gamma (the RoPE key is
one head shared by all: untouched), the values by 1.

The largest logit is taken where each attention kernel (CausalSDPA) is called, of the scores it lets through (its
mask: causal, windows, chunks, documents; DSA's selected keys; V4's entries), by the kernel itself
(CausalSDPA.max_logits, block by block), over the step's micro-batches (its recomputations under activation
checkpointing give the same), then over the data-parallel ranks, which saw other sequences; tensor parallelism's
ranks each hold their heads, so each scales its own rows. Eval-mode forwards (validation, evaluation) are not
counted. The scale of a sharded weight is applied to each rank's shard (any placement)."""

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tessera.models.common.attention import CausalSDPA
from tessera.tensors import plain_tensor

Rule = Mapping[str, tuple[tuple[int, float], ...]]  # projection -> per head: (rows, power of gamma), in order


def row_scales(gamma: torch.Tensor, segments: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """[heads x rows per head]: each output row's factor, gamma[head] ** its segment's power."""
    per_head = [gamma[:, None].pow(power).expand(-1, rows) for rows, power in segments]
    return torch.cat(per_head, dim=1).reshape(-1)


def scale_rows(weight: torch.Tensor, scales: torch.Tensor) -> None:
    """weight [rows, ...] *= scales [rows] along its rows, on this rank's shard of a sharded weight."""
    weight = plain_tensor(weight)
    whole = scales.to(weight.dtype).view(-1, *[1] * (weight.dim() - 1)).expand(weight.shape)
    if isinstance(weight, DTensor):
        whole = distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        weight = weight.to_local()
    weight.mul_(whole)


class QKClip:
    """Records each attention kernel's largest logit per head while training (forward hooks), and clips after the
    optimizer step. `dp_group`: the ranks that saw other sequences with the same heads; `tp_group`: those
    holding the other heads; `pp_group`: the other stages (for the metrics)."""

    def __init__(self, model: nn.Module, rule: Rule, threshold: float, dp_group=None, tp_group=None,
                 pp_group=None):
        self.threshold, self.dp_group, self.tp_group, self.pp_group = threshold, dp_group, tp_group, pp_group
        self.attention = [m for m in model.modules() if isinstance(getattr(m, "sdpa", None), CausalSDPA)
                          and all(hasattr(m, name) for name in rule)]
        self.rule = rule
        self.seen: dict[int, torch.Tensor] = {}  # attention index -> its heads' largest logit so far this step
        self.last = (0.0, 0)  # the last step's largest logit (tensor), heads clipped
        for i, module in enumerate(self.attention):
            module.sdpa.register_forward_hook(self._recorder(i), with_kwargs=True)

    def _recorder(self, index: int):
        def record(kernel: CausalSDPA, args: tuple, kwargs: dict, out) -> None:
            if not kernel.training:
                return
            q, k, _, *rest = args
            documents = rest[0] if rest else kwargs.get("documents")
            found = kernel.max_logits(q, k, documents, kwargs.get("entries"), kwargs.get("selected"),
                                      kwargs.get("k_first", 0))
            held = self.seen.get(index)
            self.seen[index] = found if held is None else torch.maximum(held, found)
        return record

    def reset(self) -> None:
        self.seen = {}

    @torch.no_grad()
    def after_step(self) -> None:
        """Clip every head over the threshold (gamma = threshold / its largest logit, over the data-parallel
        ranks), then forget the step's logits."""
        if not self.attention or len(self.seen) != len(self.attention):
            self.reset()  # a step that ran no training forward here (none to clip)
            return
        largest = torch.stack([self.seen[i] for i in range(len(self.attention))])  # [modules, local heads]
        if self.dp_group is not None:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.dp_group)
        if self.tp_group is not None:  # every TP rank's heads, in rank order (TP splits them so)
            parts = [torch.empty_like(largest) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(parts, largest, group=self.tp_group)
            largest = torch.cat(parts, dim=1)
        gamma = (self.threshold / largest).clamp(max=1.0)
        self.last = (largest.max(), (gamma < 1).sum())
        for module, g in zip(self.attention, gamma, strict=True):
            if bool((g < 1).any()):
                for name, segments in self.rule.items():
                    scale_rows(getattr(module, name).weight, row_scales(g, segments))
        self.reset()

    def metrics(self, device: torch.device) -> dict[str, float]:
        """The last step's largest attention logit (every stage's) and how many heads it clipped. Every rank calls
        it at the same steps."""
        largest, clipped = (torch.as_tensor(v, device=device, dtype=torch.float32) for v in self.last)
        if self.pp_group is not None:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.pp_group)
            dist.all_reduce(clipped, group=self.pp_group)
        return {"qk_max_logit": largest.item(), "qk_clipped_heads": clipped.item()}
