"""The shared mixture-of-experts layer (parallelism-free): grouped GEMMs equal the per-expert loop (forward and
backward, fp32, 1e-6) with uneven and empty loads, routing options do what they say, runs reproduce bit for bit,
and token counts are not doubled by activation checkpointing."""

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tessera.models.common.moe import MoE
from tessera.models.common.moe_args import MoEArgs

DIM = 16


def _layer(grouped: bool = True, seed: int = 0, aux_loss_coef: float = 0.0, force_balanced: bool = False,
           **kw) -> MoE:
    args = MoEArgs(**{"n_experts": 8, "top_k": 2, "hidden": 24, **kw})
    layer = MoE(DIM, args, grouped=grouped)
    layer.aux_loss_coef, layer.router.force_balanced = aux_loss_coef, force_balanced
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def _x(seed: int = 1, batch: int = 3, seq: int = 10) -> torch.Tensor:
    return torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _run(layer: MoE, x: torch.Tensor):
    out = layer(x)
    out.sum().backward()  # the gradient of a sum has zero strides: the grouped path must take it
    return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("kw", [{}, {"n_shared": 1}, {"score_func": "sigmoid", "route_scale": 2.5},
                                {"score_before_experts": True, "top_k": 1}])
def test_grouped_experts_equal_the_loop(kw):
    grouped, loop = _layer(True, **kw), _layer(False, **kw)
    for layer in (grouped, loop):  # the selection bias starves expert 3 and crowds expert 5
        layer.expert_bias[3], layer.expert_bias[5] = -100.0, 1.0
    a, b = _run(grouped, _x()), _run(loop, _x())
    assert grouped.tokens_per_expert[3] == 0 and grouped.tokens_per_expert[5] == 30
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], rtol=1e-6, atol=1e-6, msg=name)


def test_runs_reproduce_bit_for_bit():
    first, second = _run(_layer(), _x()), _run(_layer(), _x())
    assert torch.equal(first[0], second[0]) and all(torch.equal(first[2][n], second[2][n]) for n in first[2])


def test_routing_options():
    x = _x().detach().reshape(-1, DIM)
    weights, experts, scores = _layer(route_scale=2.0).router(x)
    torch.testing.assert_close(weights.sum(-1), torch.full((len(x),), 2.0))  # renormalized, then scaled
    assert torch.equal(experts, scores.topk(2, dim=-1).indices)
    _, experts, _ = _layer(n_groups=4, top_groups=2).router(x)
    assert all(len(set((e // 2).tolist())) <= 2 for e in experts)  # within 2 of the 4 groups of 2 experts
    _, experts, _ = _layer(force_balanced=True).router(x[:28])
    assert torch.bincount(experts.view(-1), minlength=8).tolist() == [7] * 8
    biased = _layer()
    biased.expert_bias[0] = 10.0  # chosen by every token, but its weight is still its own score
    weights, experts, scores = biased.router(x, biased.expert_bias)
    assert (experts == 0).any(-1).all()
    unnormed = dataclasses.replace(biased.args, route_norm=False)
    biased.router.args = unnormed
    weights, experts, scores = biased.router(x, biased.expert_bias)
    torch.testing.assert_close(weights, scores.gather(-1, experts))


def test_token_counts_are_not_doubled_by_activation_checkpointing():
    layer, x = _layer(), _x()
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # the forward runs again inside backward
    assert layer.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 2


def test_sequence_aux_loss_is_smallest_for_a_balanced_router():
    x = _x().detach()
    balanced, skewed = _layer(aux_loss_coef=0.1), _layer(aux_loss_coef=0.1)
    with torch.no_grad():
        balanced.router.gate.weight.zero_()  # uniform scores
        skewed.router.gate.weight[0] = 5.0
    with torch.no_grad():
        balanced(x), skewed(x)
    assert balanced.aux_loss_sum.item() == pytest.approx(0.1, rel=1e-5)
    assert skewed.aux_loss_sum > 1.2 * balanced.aux_loss_sum


def test_the_aux_loss_gradient_is_that_of_adding_it_to_the_loss():
    """Its backward starts at the layer's output (so it needs no path to the loss under pipelining), scaled by
    the micro-batch's share: the same gradients as adding share x coef x aux to the loss."""
    x = _x().detach()
    attached, added = _layer(aux_loss_coef=0.1), _layer()
    attached.aux_scale = 0.25
    attached(x).square().mean().backward()
    out = added(x)
    weights, experts, scores = added.router(x.reshape(-1, DIM), added.expert_bias)
    aux = added.sequence_aux_loss(scores.view(3, 10, -1), experts.view(3, 10, 2))
    (out.square().mean() + 0.25 * 0.1 * aux).backward()
    assert attached.router.gate.weight.grad.abs().sum() > 0
    for (name, a), b in zip(attached.named_parameters(), added.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)
