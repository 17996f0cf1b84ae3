"""A token-choice mixture-of-experts layer, parallelism-free: router, stacked experts (grouped GEMMs, or a
per-expert loop that is the test oracle and the fallback), shared experts, and the load statistics that
balancing needs. Token order after routing is a stable sort by expert, so runs reproduce bit for bit."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.common.attention import FeedForward
from tessera.models.common.moe_args import MoEArgs
from tessera.models.common.side_loss import AddLossGrad


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's backward refuses one
    with zero strides (the gradient of a sum, say)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _local(w: torch.Tensor) -> torch.Tensor:
    """Expert parallelism holds the stacks as DTensors split over experts; the math runs on this rank's."""
    return w.to_local() if isinstance(w, DTensor) else w


def _grouped_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm wants rows whose byte strides are multiples of 16, and a float dtype it supports; traced
    by torch.compile, bf16 only (torch 2.13's shape function refuses fp32, which eager CPU runs)."""
    align = 16 // x.element_size()
    dtypes = (torch.bfloat16,) if torch.compiler.is_compiling() else (torch.float32, torch.bfloat16)
    return x.dtype in dtypes and all(d % align == 0 for w in weights for d in w.shape[1:])


class Experts(nn.Module):
    """E SwiGLU experts stored stacked: w1 (gate), w3 (up) [E, hidden, dim], w2 [E, dim, hidden]; with `args.bias`
    w1_bias, w3_bias [E, hidden] and w2_bias [E, dim]."""

    ADAPTABLE = ("w1", "w2", "w3")  # the stacks LoRA may adapt (`adapt`)

    def __init__(self, dim: int, args: MoEArgs, grouped: bool = True):
        super().__init__()
        n, hidden = args.n_experts, args.hidden
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        if args.bias:
            self.w1_bias, self.w2_bias, self.w3_bias = (nn.Parameter(torch.empty(n, d)) for d in (hidden, dim, hidden))
        else:
            self.w1_bias = self.w2_bias = self.w3_bias = None
        self.limit, self.alpha, self.up_shift = args.swiglu_limit, args.swiglu_alpha, args.swiglu_up_shift
        self.grouped = grouped
        self.adapted: dict[str, tuple[float, float]] = {}  # LoRA: stack -> (scale, dropout) of its adapters

    def adapt(self, name: str, rank: int, scale: float, dropout: float) -> None:
        """A low-rank update beside stack `name` (tessera.lora): `{name}_lora_a` [E, rank, in] and `{name}_lora_b`
        [E, out, rank], adding scale * B_e A_e dropout(x) to expert e's output, as LoRA does beside a linear."""
        w = getattr(self, name)
        self.register_parameter(f"{name}_lora_a", nn.Parameter(w.new_empty(w.shape[0], rank, w.shape[2])))
        self.register_parameter(f"{name}_lora_b", nn.Parameter(w.new_empty(w.shape[0], w.shape[1], rank)))
        self.adapted[name] = (scale, dropout)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not self.limit:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(self.alpha * gate) * (up + self.up_shift)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim]: tokens sorted by expert, `counts` [E] of them each -> [N, dim]."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.w1_bias is not None:  # each row's expert's bias
            rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=len(x))
            b1, b2, b3 = (_local(b)[rows] for b in (self.w1_bias, self.w2_bias, self.w3_bias))
        else:
            b1 = b2 = b3 = 0
        adapters = {n: (_local(getattr(self, f"{n}_lora_a")), _local(getattr(self, f"{n}_lora_b")))
                    for n in self.adapted}
        if self.grouped and _grouped_ok(x, w1, w2, *(t for pair in adapters.values() for t in pair)):
            offsets = counts.cumsum(0).to(torch.int32)

            def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # offs by keyword: torchao's Float8 weights
                return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)  # quantize only a call that names it
        else:  # the oracle: one matmul per expert
            sizes = counts.tolist()

            def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return torch.cat([F.linear(part, w[e]) for e, part in enumerate(a.split(sizes))])

        def project(a: torch.Tensor, name: str, w: torch.Tensor) -> torch.Tensor:
            if name not in adapters:
                return mm(a, w)
            (scale, dropout), (lora_a, lora_b) = self.adapted[name], adapters[name]
            dropped = F.dropout(a, dropout, self.training) if dropout else a
            return mm(a, w) + scale * mm(mm(dropped, lora_a), lora_b)

        x = _ContiguousGrad.apply(x)
        h = self._glu(project(x, "w1", w1) + b1, project(x, "w3", w3) + b3)
        return _ContiguousGrad.apply(project(h, "w2", w2)) + b2


SCORES = {"softmax": lambda logits: logits.softmax(-1), "sigmoid": torch.sigmoid,
          "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt()}


class Router(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=args.bias)
        self.force_balanced = False  # debug: deal tokens to experts round-robin (benchmarks of an even load)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (top-k weights [T, k], their experts [T, k], every expert's score [T, E]).
        `bias` [E] shifts which experts are chosen, not the weights they get; `experts` [T, k]: chosen already
        (hash routing), only weighed here."""
        a = self.args
        gate_bias = None if self.gate.bias is None else self.gate.bias.float()
        logits = F.linear(x.float(), self.gate.weight.float(), gate_bias)
        scores = SCORES[a.score_func](logits)
        if experts is not None:
            return self._weighed(scores, experts), experts, scores
        choice = scores if bias is None else scores + bias
        if a.n_groups > 1:  # keep the top_groups groups, ranked by the sum of their two best scores
            grouped = choice.view(len(x), a.n_groups, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1).topk(a.top_groups, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(len(x), -1)
        if self.force_balanced:
            experts = torch.arange(len(x) * a.top_k, device=x.device).view(len(x), a.top_k) % a.n_experts
        else:
            experts = choice.topk(a.top_k, dim=-1).indices
        return self._weighed(scores, experts), experts, scores

    def _weighed(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(-1, experts)
        if self.args.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.args.route_scale


class MoE(nn.Module):
    """Routed experts (+ shared ones) for every token. After each forward, `tokens_per_expert` has grown by the
    tokens each expert got (once per forward, not again when activation checkpointing recomputes it).

    `expert_bias` (aux-loss-free balancing) shifts which experts are chosen, never their weights; it is state
    that training updates, kept in checkpoints. With `aux_loss_coef` the sequence-wise balancing loss, times
    `aux_scale` (a micro-batch's share of the step), gets its gradient in backward, and `aux_loss_sum` adds up
    its values."""

    def __init__(self, dim: int, args: MoEArgs, grouped: bool = True):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = Experts(dim, args, grouped)
        self.shared = FeedForward(dim, args.n_shared * args.hidden, args.swiglu_limit if args.clamp_shared else 0.0) \
            if args.n_shared else None
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        # hash routing: each token id's experts (a fixed table, state like the bias: checkpoints keep it)
        self.register_buffer("hash_experts", torch.zeros(args.hash_vocab, args.top_k, dtype=torch.long)
                             if args.hash_vocab else None)
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.aux_loss_coef, self.aux_scale = 0.0, 1.0
        self.aux_loss_sum = torch.zeros(())

    def reset_buffers(self) -> None:
        """Zero the balancing state (after materializing on a device, before any load); a hash table is dealt
        afresh: each token id's top_k experts drawn without repeats, seeded (the same on every rank)."""
        if self.hash_experts is not None:
            gen = torch.Generator().manual_seed(self.args.hash_seed)
            draws = torch.rand(len(self.hash_experts), self.args.n_experts, generator=gen)
            self.hash_experts.copy_(draws.topk(self.args.top_k, dim=-1).indices)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        self.aux_loss_sum = torch.zeros((), device=self.expert_bias.device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """`ids` [batch, seq]: x's token ids, which hash routing reads."""
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        k = self.args.top_k
        hashed = None if self.hash_experts is None else self.hash_experts[ids.reshape(-1)]
        weights, experts, scores = self.router(flat, self.expert_bias, hashed)
        order = experts.view(-1).argsort(stable=True)  # (token, slot) pairs grouped by expert, in token order
        counts = torch.bincount(experts.view(-1), minlength=self.args.n_experts)
        tokens = flat[order // k]
        w = weights.view(-1)[order, None].to(x.dtype)
        out = self.experts(tokens * w if self.args.score_before_experts else tokens, counts)
        if not self.args.score_before_experts:
            out = out * w
        out = out[order.argsort()].view(-1, k, dim).sum(1)  # back to token order, slots summed in a fixed order
        if self.shared is not None:
            out = out + self.shared(flat)
        first_run = torch._C._current_graph_task_id() == -1  # not a recompute inside backward
        if first_run:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        if self.aux_loss_coef:
            aux = self.aux_loss_coef * self.sequence_aux_loss(scores.view(bsz, seq, -1), experts.view(bsz, seq, k))
            if first_run:
                self.aux_loss_sum = self.aux_loss_sum + aux.detach()
            if torch.is_grad_enabled():
                out = AddLossGrad.apply(out, aux * self.aux_scale)  # trains the router from its own stage
        return out.view(bsz, seq, dim)

    def sequence_aux_loss(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Per sequence: sum over experts of (its share of the routed slots x E) x (its mean normalized score),
        averaged over sequences (DeepSeek V3's complementary sequence-wise loss; 1 when perfectly even)."""
        n = self.args.n_experts
        share = torch.zeros(*experts.shape[:1], n, device=scores.device).scatter_add_(
            1, experts.flatten(1), torch.ones_like(experts.flatten(1), dtype=torch.float)) * n / experts[0].numel()
        probs = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return (share * probs).sum(-1).mean()
