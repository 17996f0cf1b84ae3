"""Activation checkpointing: recompute (some) block activations in backward instead of keeping them.

full: every block keeps only its input; selective "op": keep attention outputs, reduce-scatter outputs
and every other matmul output, recompute the cheap rest; selective N: full AC on every N-th block.
Blocks are wrapped in place, so `_checkpoint_wrapped_module` appears in module paths; DCP state dicts
(get_model_state_dict) and materialize() strip it, so checkpoints and initial weights do not change.
"""

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    create_selective_checkpoint_contexts,
)


def _ops(*names: str, namespace=torch.ops.aten) -> set:
    """The `.default` overloads of those named ops that this torch build registers."""
    found = set()
    for name in names:
        try:
            found.add(getattr(namespace, name).default)
        except (AttributeError, RuntimeError):
            pass
    return found


# Outputs worth keeping: expensive to recompute, cheap to hold. Every SDPA kernel CPU/CUDA may pick.
_SAVE = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
# The amax behind a float8 scale: a scalar, so keeping it is free and recomputing it is a full pass.
_SAVE |= {torch.ops.aten.max.default}
_MM = torch.ops.aten.mm.default


def _reduce_scatter_ops() -> set:
    try:
        return _ops("reduce_scatter_tensor", namespace=torch.ops._c10d_functional)
    except (AttributeError, RuntimeError):
        return set()


def op_policy():
    """The per-op policy for one block forward (and its recompute): what to keep, what to recompute."""
    save = _SAVE | _reduce_scatter_ops() | {_MM}
    mm_count = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func == _MM:
            # Forward and recompute count separately so both make the same choice for the same mm
            # (torch >= 2.12 decides once, in forward, and replays it; older torch asks again).
            key = "recompute" if ctx.is_recompute else "forward"
            mm_count[key] += 1
            if mm_count[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# SAC numbers every op of a block's forward and replays its recompute by those numbers, but the work FSDP's hooks do
# for a module sharded on its own inside a block (MoE experts, over their mesh) depends on FSDP's state, which under
# PP differs between the two: a root pre-forward mark and an all-gather's copies run in the recompute and not in the
# forward it repeats, and the extra ops failed the backward ("... not found in storage"). FSDP marks
# all of its work with record_function ("FSDP::..."): both modes pass the marks, and every op inside FSDP's, through
# uncounted, as torch's SAC does its own ignored ops.
_ENTER = {torch.ops.profiler._record_function_enter, torch.ops.profiler._record_function_enter_new}
_EXIT = torch.ops.profiler._record_function_exit


class _PassFsdpWork:
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inside = self.__dict__.setdefault("fsdp_marks", [])  # the open marks, from FSDP's outermost one
        packet = getattr(func, "overloadpacket", None)
        if packet in _ENTER:
            mark = func(*args, **(kwargs or {}))
            if inside or str(args[0]).startswith("FSDP::"):
                inside.append(mark)
            return mark
        if packet == _EXIT:
            if inside and args[0] is inside[-1]:
                inside.pop()
            return func(*args, **(kwargs or {}))
        if inside:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _SavingMode(_PassFsdpWork, _CachingTorchDispatchMode):
    pass


class _ReplayMode(_PassFsdpWork, _CachedTorchDispatchMode):
    pass


def _op_policy_context():
    saving, replay = create_selective_checkpoint_contexts(op_policy())
    return _SavingMode(saving.policy_fn, saving.storage), _ReplayMode(None, replay.storage)


def _wrap(block: nn.Module, **kwargs) -> nn.Module:
    # preserve_rng_state=False: blocks draw no random numbers (no dropout), and saving RNG state costs a sync.
    return checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def apply_ac(blocks: nn.ModuleDict, mode: str, option: str = "") -> None:
    """Wrap the blocks of `blocks` in place. mode: none | full | selective (option "op" or an integer N)."""
    if mode == "none":
        return
    if mode == "full":
        every = 1
    elif mode == "selective" and option == "op":
        for name, block in blocks.items():
            blocks[name] = _wrap(block, context_fn=_op_policy_context)
        return
    elif mode == "selective" and option.isdigit() and int(option) >= 1:
        every = int(option)
    else:
        raise ValueError(f"activation checkpointing: unknown mode {mode!r} / option {option!r}")
    for i, (name, block) in enumerate(blocks.items(), start=1):
        if i % every == 0:
            blocks[name] = _wrap(block)
