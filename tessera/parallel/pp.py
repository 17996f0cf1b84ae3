"""Pipeline parallelism: cut a meta-device model into stages by layers and run them with a
torch.distributed.pipelining schedule. Parameter names stay those of the whole model, so checkpoints
move freely between pipeline layouts."""

import copy
import logging
import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineScheduleRuntime, get_schedule_class

from tessera.parallel import pp_layout


def _numbered(model: nn.Module, blocks: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """(stack, key, global number) of every block: the stacks' blocks in forward order, stack after stack."""
    out = []
    for stack in blocks:
        out += [(stack, key, len(out) + i) for i, key in enumerate(getattr(model, stack))]
    return out


def cut(model: nn.Module, layer_ids: list[int], *, blocks: tuple[str, ...] = ("layers",),
        drop: tuple[str, ...] = ()) -> nn.Module:
    """A copy of `model` (on meta, so cheap) holding only the blocks numbered `layer_ids` of its block stacks
    (ModuleDicts keyed by int, in forward order), without the modules named in `drop` (a middle stage drops the
    first and the last stage's)."""
    stage = copy.deepcopy(model)
    keep = {(stack, key) for stack, key, n in _numbered(model, blocks) if n in layer_ids}
    for stack in blocks:
        setattr(stage, stack, nn.ModuleDict({k: v for k, v in getattr(stage, stack).items() if (stack, k) in keep}))
    for name in drop:
        setattr(stage, name, None)
    return stage


def split(model: nn.Module, pp_mesh: DeviceMesh, cfg, first_modules: tuple[str, ...],
          last_modules: tuple[str, ...],
          blocks: tuple[str, ...] = ("layers",)) -> tuple[list[int], list[nn.Module], int]:
    """The stage indices this rank runs, their modules (still on meta), and the number of stages."""
    p = cfg.parallelism
    n_layers = len(_numbered(model, blocks))
    n_stages = pp_layout.num_stages(n_layers, p.pipeline_parallel_degree, p.pipeline_parallel_schedule,
                                    p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_split_points,
                                    p.pipeline_parallel_first_stage_less_layers,
                                    p.pipeline_parallel_last_stage_less_layers)
    layout = pp_layout.stage_layers(n_layers, n_stages, p.pipeline_parallel_split_points,
                                    p.pipeline_parallel_first_stage_less_layers,
                                    p.pipeline_parallel_last_stage_less_layers)
    ids = pp_layout.rank_stages(pp_mesh.get_local_rank(), p.pipeline_parallel_degree, n_stages,
                                p.pipeline_parallel_schedule)
    parts = [cut(model, layout[i], blocks=blocks, drop=(() if i == 0 else first_modules)
                 + (() if i == n_stages - 1 else last_modules)) for i in ids]
    return ids, parts, n_stages


class MicrobatchReducingStage(PipelineStage):
    """A stage whose FSDP groups reduce-scatter each micro-batch's gradients into the sharded ones and free their
    gathered parameters after its backward, as without pipelining (torch's stage keeps both to the step's end,
    the unsharded gradients accumulating: a whole stage's gradients and parameters held at once). Only for
    schedules whose backwards are whole (see splits_backward)."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(True)  # the final callback waits for this micro-batch's reduction
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]), \
            None


ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def splits_backward(p) -> bool:
    """Whether the schedule (of config section `p`) splits backwards into the inputs' and, later, the weights'
    (zero bubble): a micro-batch's weight gradients may then come after another's, so they are reduced once, at
    the step's end. A CSV schedule does when it holds I or W actions (e.g. 0I3, 1W0)."""
    if p.pipeline_parallel_schedule_csv:
        with open(p.pipeline_parallel_schedule_csv) as fh:
            return re.search(r"\d[IW]\d", fh.read()) is not None
    return p.pipeline_parallel_schedule in ZERO_BUBBLE


def reduces_each_microbatch(cfg) -> bool:
    """parallelism.pipeline_parallel_grad_reduce = microbatch, for a schedule whose backwards are whole."""
    return cfg.parallelism.pipeline_parallel_grad_reduce == "microbatch" and not splits_backward(cfg.parallelism)


def make_stage(part: nn.Module, stage_id: int, n_stages: int, device: torch.device, pp_mesh: DeviceMesh,
               cfg) -> PipelineStage:
    """Torch's stage, or the one that reduces each micro-batch's gradients (reduces_each_microbatch)."""
    cls = MicrobatchReducingStage if reduces_each_microbatch(cfg) else PipelineStage
    return cls(part, stage_id, n_stages, device, group=pp_mesh.get_group())


def keep_gathered(parts: list[nn.Module], p, warn: bool) -> None:
    """Under a split backward, FSDP groups keep their gathered parameters from forward on (the schedule's own
    RESHARD action frees them after the stage's last weight pass). A micro-batch's input pass picks the weights it
    leaves to the weight pass among the stage's parameters as they are then: a group resharded after a later
    forward holds its shards there, so that micro-batch's weight gradients were never computed (no error)."""
    if p.fsdp_reshard_after_forward == "always" and warn:
        name = p.pipeline_parallel_schedule_csv or p.pipeline_parallel_schedule
        logging.getLogger("tessera").warning(
            f"parallelism.fsdp_reshard_after_forward = always: {name} splits backwards (zero bubble), whose weight "
            f"passes need the gathered parameters: they stay gathered from forward to the step's end")
    for module in (m for part in parts for m in part.modules()):
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(False, recurse=False)


def build_schedule(parts: list[nn.Module], stage_ids: list[int], n_stages: int, pp_mesh: DeviceMesh,
                   device: torch.device, cfg, loss_fn):
    """`loss_fn` must already scale each micro-batch's share of the step: the schedule does not scale gradients,
    because its scaling would also rescale gradients accumulated by earlier steps of gradient accumulation."""
    p = cfg.parallelism
    if p.pipeline_parallel_grad_reduce == "microbatch" and splits_backward(p) and pp_mesh.get_rank() == 0:
        name = p.pipeline_parallel_schedule_csv or p.pipeline_parallel_schedule
        logging.getLogger("tessera").warning(
            f"parallelism.pipeline_parallel_grad_reduce: {name} splits backwards (zero bubble): gradients are "
            f"reduced at the step's end; use a schedule without split backwards (1F1B, Interleaved1F1B...) to "
            f"reduce them after each micro-batch")
    if splits_backward(p):
        keep_gathered(parts, p, pp_mesh.get_rank() == 0)
    stages = [make_stage(part, i, n_stages, device, pp_mesh, cfg) for part, i in zip(parts, stage_ids, strict=True)]
    n_micro = cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size
    if p.pipeline_parallel_schedule_csv:
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
        schedule._load_csv(p.pipeline_parallel_schedule_csv)
        return schedule, stages
    cls = get_schedule_class(p.pipeline_parallel_schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
    return schedule, stages


def forget_shape_inference(stage: nn.Module, recorders: list[nn.Module]) -> None:
    """Reset `recorders` (modules of the stage with a reset(): side losses) as the stage's second forward starts:
    torch's PipelineStage runs the first on uninitialized tensors to infer shapes; what they recorded then goes."""
    forwards = []

    def count(module: nn.Module, args) -> None:
        forwards.append(module)
        if len(forwards) == 2:
            for m in recorders:
                m.reset()
            handle.remove()
    handle = stage.register_forward_pre_hook(count)


def parts_view(parts: list[nn.Module], names: tuple[str, ...], blocks: tuple[str, ...] = ("layers",)) -> nn.Module:
    """One module over this rank's stages with the whole model's parameter names, for optimizer and DCP."""
    view = nn.Module()
    for name in names:
        found = [getattr(p, name) for p in parts if getattr(p, name, None) is not None]
        if found:
            setattr(view, name, found[0])
    for stack in blocks:
        held = sorted(((k, v) for p in parts for k, v in getattr(p, stack).items()), key=lambda kv: int(kv[0]))
        setattr(view, stack, nn.ModuleDict(held))
    return view
