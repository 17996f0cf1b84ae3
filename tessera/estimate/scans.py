"""The chunked Gated DeltaNet's scan across chunks (tessera.models.common.deltanet.delta_scan), as the estimate
traces it: its bytes, allocated in a few ops. Traced op by op, the scan is a dozen ops per chunk forward and as many
backward (64 chunks at 4k tokens, per DeltaNet layer and per trace of a layout), which made most of an estimate's
time and kept `plan` on Qwen 3.5 from finishing.

What the scan allocates: forward, the state entering each chunk and each chunk's correction (both saved for
backward by its matmuls), each chunk's output then all of them stacked, and the final state; backward, the
gradients of its inputs. The loop frees its saved states chunk by chunk as its gradients come, here they are freed
at the end of its backward: the scan's own backward peak is counted high by up to its saved states (about a tenth
of it), a layer's and a model's hardly (their peak is elsewhere). tests/test_qwen3_5_plan.py compares a layer
traced both ways."""

import torch
from torch import nn

from tessera.models.common import deltanet


class _ScanBytes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, w, q_read, attn, k_write, carry, s):
        bsz, heads, n = u.shape[:3]
        states = s.new_empty(bsz, heads, max(n - 1, 0), *s.shape[2:])  # the states entering chunks 1..n-1
        new = u.new_empty(u.shape)  # each chunk's correction
        pieces = u.new_empty(u.shape)  # each chunk's output, until stacked
        out = u.new_empty(u.shape)
        del pieces
        ctx.save_for_backward(w, q_read, attn, k_write, carry, s, states, new)
        ctx.u_shape = u.shape
        return out, s.new_empty(s.shape)

    @staticmethod
    def backward(ctx, d_out, d_state):
        w, q_read, attn, k_write, carry, s = ctx.saved_tensors[:6]  # the states and corrections: kept till here
        like = [(ctx.u_shape, w), *((t.shape, t) for t in (w, q_read, attn, k_write, carry, s))]
        grads = [t.new_empty(shape) if needed else None
                 for (shape, t), needed in zip(like, ctx.needs_input_grad, strict=True)]
        return tuple(grads)


def scan_bytes(u, w, q_read, attn, k_write, carry, s) -> tuple[torch.Tensor, torch.Tensor]:
    return _ScanBytes.apply(u, w, q_read, attn, k_write, carry, s)


def scans_at_once(model: nn.Module) -> nn.Module:
    """`model`'s DeltaNet layers, traced with `scan_bytes` for their scan."""
    for rule in model.modules():
        if isinstance(rule, deltanet.DeltaRule):
            rule.scan = scan_bytes
    return model
