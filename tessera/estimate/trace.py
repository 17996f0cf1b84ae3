"""One rank of a configured run, traced without memory: the model built as the trainer builds it (on meta, the
family's parallelism plan over a fake process group of N ranks), its parameters fake tensors, and micro-batches
run forward and backward while tessera.memory.LiveBytes counts every storage that would be allocated."""

import contextlib
import dataclasses
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from tessera import experts
from tessera.distributed import World, mesh_world
from tessera.memory import LiveBytes
from tessera.models.common import attention, sparse
from tessera.models.common.decoder import Decoder
from tessera.optim_state import state_bytes
from tessera.parallel.fsdp import mixed_precision
from tessera.parallel.tp import loss_context
from tessera.run_plan import Batch
from tessera.step import LossScale, forward_backward
from tessera.trainer import build_step, step_loss, token_inputs

_SMALL = 1 << 16  # integer tensors up to this many elements carry values under EvenRouting
_COLLECTIVES = ("c10d", "_c10d_functional", "fsdp")
_UNINITIALIZED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


@contextlib.contextmanager
def fake_world(dims, rank: int):
    """The World rank `rank` of `dims.world_size` sees, over a fake process group (collectives do nothing)."""
    device = torch.device("cpu")
    if dims.world_size == 1:
        yield World(0, 0, 1, device, dims, None)
        return
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=dims.world_size)
    try:
        yield mesh_world(dims, rank, 0, device)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding and redistribution plans by mesh, and a mesh of the next fake world equals one of
    this world (same shape and names) but holds other process groups: the caches must not outlive the world."""
    from torch.distributed.tensor import _redistribute, _sharding_prop

    torch._C._clear_DTensor_sharding_propagator_cache()  # the native dispatch's
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def gpu_attention(model: nn.Module) -> nn.Module:
    """On CUDA no attention keeps scores: narrower masks (windows, chunks, documents, sinks, context-parallel chunks)
    run on FlexAttention, heads wider than 128, selected keys (DSA) and compressed entries (DeepSeek V4) on the
    blockwise kernel; on a CPU the blockwise kernel runs everything, a Python loop over blocks that would be slow to
    trace at length. Traced for a GPU, attention is computed by flash SDPA where it takes the shapes, else by a
    stand-in that keeps what a fused kernel keeps (its output and log-sum-exp): `model`'s attention kernels are
    given that function (attention.use_attention)."""
    return sparse.use_index_kernels(attention.use_attention(model, _flex_like), _fused_top_k, _fused_kl)


def _fused_top_k(scoring, topk: int, stable: bool = False) -> torch.Tensor:
    """A fused top-k's memory: the indices alone."""
    return scoring.q.new_empty(*scoring.q.shape[:2], min(topk, scoring.k.shape[1]), dtype=torch.long)


def _fused_kl(scoring, target, selected=None) -> torch.Tensor:
    """sparse.indexer_kl's memory: its gradients, made with the loss, kept for backward."""
    inputs = (scoring.q, scoring.k, scoring.w)
    return sparse.WithGradients.apply(scoring.q.new_zeros((), dtype=torch.float32), 3, *inputs,
                                    *(torch.empty_like(x) for x in inputs))


def _flex_like(q, k, v, window=0, chunk=0, scale=None, sinks=None, documents=None, masks=None, entries=None,
               selected=None, k_first=0):
    chosen = selected if selected is not None else None if entries is None else entries.selected
    plain = entries is None and selected is None and not k_first
    if plain and q.shape[2] > 1 and max(q.shape[-1], v.shape[-1]) <= 128:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    out = _Fused.apply(q, k, v, *(() if entries is None else (entries.kv,)))
    return out if chosen is None else (out, q.new_empty(q.shape[0], q.shape[2], chosen.shape[-1]))


class _Fused(torch.autograd.Function):
    """A fused attention kernel's memory: it keeps its inputs, its output [batch, heads, n_q, dv] and one fp32
    log-sum-exp per query and head, and its backward makes each input's gradient."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], kv[1].shape[-1])
        ctx.save_for_backward(q, *kv, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = ctx.saved_tensors[:-2]
        return tuple(torch.empty_like(t) for t in inputs)


class EvenRouting(TorchDispatchMode):
    """Fake tensors hold no values, but routing tokens to experts reads some back: the tokens per expert (a
    bincount), the sizes an all-to-all sends. Under this mode they come out as under an even load: a bincount of
    n ids over E bins gives n / E to each (the remainder to the first ones); small integer tensors computed from
    such values, or from no tensor at all (an arange), carry their values; a collective passes its input's values
    on (every rank routes alike); and reading one into Python gives them. Values are kept per storage (a real
    copy of it), so views of a tensor carry them too."""

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode, self.store = fake_mode, {}  # id(storage) -> (weak reference, its real elements)

    def get(self, t: torch.Tensor) -> torch.Tensor | None:
        entry = self.store.get(id(t.untyped_storage()))
        if entry is None or entry[0]() is not t.untyped_storage() or entry[1].dtype != t.dtype:
            return None
        with _disable_current_modes():
            return entry[1].as_strided(t.shape, t.stride(), t.storage_offset())

    def set(self, t: torch.Tensor, value: torch.Tensor) -> None:
        st, key = t.untyped_storage(), id(t.untyped_storage())
        with _disable_current_modes():
            if self.get(t) is None:
                flat = torch.zeros(st.nbytes() // t.element_size(), dtype=t.dtype)
                self.store[key] = (weakref.ref(st, lambda _, k=key: self.store.pop(k, None)), flat)
            # A clone: a view's value (labels cut in chunks) may be a view of the very elements it is written to.
            target, value = self.get(t), value.reshape(t.shape).clone()
            # An expanded view (stride 0: a value repeated, such as a sequence padded with its last id) holds
            # each element once: written through one index of each such dim.
            for dim in [d for d, stride in enumerate(target.stride()) if stride == 0 and target.shape[d] > 1]:
                target, value = target.narrow(dim, 0, 1), value.narrow(dim, 0, 1)
            target.copy_(value)

    def forget(self, t: torch.Tensor) -> None:
        self.store.pop(id(t.untyped_storage()), None)

    def _fake(self, value: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)  # through the modes below
        self.set(out, value)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func is torch.ops.aten._local_scalar_dense.default and self.get(args[0]) is not None:
            with _disable_current_modes():
                return self.get(args[0]).item()
        if func is torch.ops.aten.bincount.default:
            bins = max(args[2] if len(args) > 2 else kwargs.get("minlength", 0), 1)
            n = args[0].numel()
            with _disable_current_modes():
                value = torch.full((bins,), n // bins, dtype=torch.int64)
                value[:n % bins] += 1
            return self._fake(value)
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
            return _grouped_mm_fp32(args, kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and func.namespace not in _COLLECTIVES and (not self.store or any(
                t.is_floating_point() for t in tensors)):
            return func(*args, **kwargs)  # float math, or nothing known yet: no value to carry
        values = [self.get(t) for t in tensors]
        if func.namespace in _COLLECTIVES:
            out = func(*args, **kwargs)
            known = next((v for v in values if v is not None), None)
            for t in [*tensors, *tree_leaves(out)] if known is not None else ():
                if isinstance(t, torch.Tensor) and t.numel() == known.numel() and not t.is_floating_point():
                    self.set(t, known)
            return out
        if any(v is None for v in values):
            out = func(*args, **kwargs)
            for t in tree_leaves(out):  # an integer tensor written from unknown values: its values are unknown
                if isinstance(t, torch.Tensor):
                    self.forget(t)
            return out
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            out = None  # a shape that depends on the values: computed on them below
        if out is not None and (func.name().split("::")[-1].split(".")[0] in _UNINITIALIZED
                                or not all(_small_int(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))):
            return out
        with _disable_current_modes():
            real_args, real_kwargs = tree_map(lambda t: self.get(t) if isinstance(t, torch.Tensor) else t,
                                              (args, kwargs))
            real = func(*real_args, **real_kwargs)
        if out is None:
            return tree_map(lambda t: self._fake(t) if isinstance(t, torch.Tensor) else t, real)
        for fake, value in zip(tree_leaves(out), tree_leaves(real), strict=True):
            if isinstance(fake, torch.Tensor):
                self.set(fake, value)
        return out


def _grouped_mm_fp32(args, kwargs) -> torch.Tensor:
    """torch._grouped_mm in fp32 (which CPUs run) has no fake implementation (it takes bf16): its output's shape
    from bf16 meta tensors, the output allocated in fp32."""
    def meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")

    with _disable_current_modes():
        shape = torch.ops.aten._grouped_mm.default(*tree_map(meta, (args, kwargs))[0], **tree_map(meta, kwargs)).shape
    return torch.empty(shape, dtype=torch.float32)


def _small_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.numel() <= _SMALL


@contextlib.contextmanager
def counting(fake: FakeTensorMode, module: nn.Module):
    """Ops on the fake tensors of `fake` (shapes and dtypes, no data), their live bytes counted, and the routing of
    `module`'s experts (if any) even: yields the meter."""
    meter = LiveBytes()
    routing = EvenRouting(fake) if experts.moe_layers(module) else contextlib.nullcontext()
    with fake, meter, routing:
        yield meter


@dataclasses.dataclass
class StageTrace:
    """Bytes, as live on this rank, of one module a rank runs (the whole model, or one pipeline stage)."""
    params: int  # parameters (this rank's shards) and buffers
    optimizer: int  # AdamW's two moments and step count, in the parameters' dtype
    grads: int  # what a backward leaves (gradients; under PP + FSDP also the parameters kept gathered)
    act: int  # what one micro-batch's forward keeps for its backward (its output included)
    peak: int  # no PP: the largest live bytes of the step (optimizer state aside)
    transient: int  # under PP: what a later backward needs beyond what is live when it starts (its activations
    first: int  # and the gradients among that); `first`: the step's first (two micro-batches held, no gradients)
    end: int  # under PP: what the gradients' reduction at the end of the step needs beyond what is live
    comm: int  # the most bytes of communication buffers alive at once (tessera.memory.LiveBytes.comm_peak)
    io: int  # bytes of one micro-batch between stages (PP: what a stage receives or sends)
    phases: tuple[int, ...] = ()  # no PP: the peaks of the step's phases (see _phase_marks); `peak` is their largest
    first_phases: tuple[int, ...] = ()  # under PP, `first` and `transient` by phase (loss and last block, middle,
    transient_phases: tuple[int, ...] = ()  # first block and after); each is its phases' largest


def optimizer_bytes(module: nn.Module, state_dtype: str = "float32") -> int:
    """AdamW/Adam keeps exp_avg and exp_avg_sq like each parameter (its local shard), or in bf16
    (optimizer.state_dtype), and a step count; of the parameters that train (LoRA's adapters, its base frozen)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters() if p.requires_grad]
    return sum(state_bytes(p.numel() * p.element_size(), p.numel(), state_dtype) for p in local)


def materialize(module: nn.Module, world: World, fake: FakeTensorMode) -> None:
    """Fake storage for every parameter and buffer, and the buffers' values computed (RoPE tables)."""
    with fake:
        module.to_empty(device=world.device)
        module.init_buffers(world.device)


def _batch(cfg, world: World, batch: int, vocab: int, bos: int | None) -> tuple[dict, torch.Tensor]:
    """The model's inputs and labels, as the trainer makes them for this rank."""
    tokens, labels = (torch.randint(0, vocab, (batch, cfg.training.seq_len)) for _ in range(2))
    return token_inputs(tokens, labels, bos, world.mesh["cp"] if world.dims.cp > 1 else None, world.device)


def trace_model(cfg, world: World, model: nn.Module, spec, args, batch: Batch, bos: int | None,
                fake: FakeTensorMode) -> StageTrace:
    """The whole model (no pipelining): the trainer's own step (build_step, forward_backward) for the step's
    micro-batches."""
    step = build_step(cfg, world, spec, model, pipeline=None, loss=step_loss(cfg, world, spec),
                      scale=LossScale(1.0 / batch.accumulation), batch=batch)
    with counting(fake, model) as meter:
        meter.track(list(model.parameters()) + list(model.buffers()))
        base, forward_end, phases = meter.current, [], []
        hooks = [model.register_forward_hook(lambda *_: forward_end.append(meter.current)), *_phase_marks(
            [getattr(model, stack)[key] for stack in spec.blocks for key in getattr(model, stack)], meter, phases)]
        inputs, labels = _batch(cfg, world, cfg.training.local_batch_size, args.vocab_size, bos)
        forward_backward(step, inputs, labels)
        phases.append(meter.peak)
        grads = meter.current - base
        if batch.accumulation > 1:  # later micro-batches run with the gradients of the first alive
            meter.reset_peak()
            forward_backward(step, inputs, labels)
            phases.append(meter.peak)
        for hook in hooks:
            hook.remove()
        return StageTrace(params=base, optimizer=optimizer_bytes(model, cfg.optimizer.state_dtype), grads=grads,
                          act=forward_end[0] - base,
                          peak=max(phases), transient=0, first=0, end=0, comm=meter.comm_peak, io=0,
                          phases=tuple(phases))


def _phase_marks(blocks: list[nn.Module], meter: LiveBytes, phases: list[int]) -> list:
    """Hooks splitting a step's peak in phases (MIDDLE: the index of the one tessera.estimate.core does not
    extrapolate): the forward up to the last block's end; the loss and the last block's backward; the middle blocks'
    backward; the first block's backward and what follows. The first, second and last grow linearly with the blocks;
    the middle's largest moment is at one of its ends (each block's backward frees its activations and adds its
    gradients alike), which its neighbours hold. Each mark appends the peak since the last and starts a new one."""
    def mark(*_):
        phases.append(meter.peak)
        meter.reset_peak()

    def on_input(_, inputs):
        if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].requires_grad:
            inputs[0].register_hook(mark)  # its gradient is ready once the last block's backward is done

    def on_output(_, inputs, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(mark)  # the first block's backward starts

    if not blocks:
        return []
    return [blocks[-1].register_forward_pre_hook(on_input), blocks[-1].register_forward_hook(mark),
            blocks[0].register_forward_hook(on_output)]


MIDDLE = 2  # and MIDDLE + 4 for a second micro-batch


def trace_stage(cfg, world: World, stage, spec, args, batch: Batch, fake: FakeTensorMode) -> StageTrace:
    """One pipeline stage (a torch PipelineStage over this rank's module), its micro-batches run the way the
    schedule runs them (FSDP without resharding or reducing between micro-batches, the gradients' reduction after
    the last): two forwards in flight, the second's backward (the step's first: no gradients yet), the first's
    backward (gradients there), then the reduction."""
    part, is_first, is_last = stage.submod, stage.is_first, stage.is_last
    # The stage's module configured as the trainer's; its schedule's forwards and backwards are run below.
    step = build_step(cfg, world, spec, part, pipeline=None, loss=step_loss(cfg, world, spec), scale=LossScale(),
                      batch=batch)
    p, t = cfg.parallelism, cfg.training
    loss, own_loss = step.loss_fn, is_last and step.labels_in_forward
    share = batch.micro_batches
    mb, seq = p.pipeline_parallel_microbatch_size, t.seq_len // world.dims.cp
    # Between stages: the residual stream (DeepSeek's training MTP: with the input embeddings beside it),
    # sequence-parallel under TP, in FSDP's compute dtype (else fp32).
    dtype = mixed_precision(t, world.device)[0] if world.dp_mesh() is not None else torch.float32
    width = part.stream_width() if isinstance(part, Decoder) else args.dim
    with fake:
        boundary = torch.empty(mb, seq // world.dims.tp, width, dtype=dtype)
        tokens, labels = _batch(cfg, world, mb, args.vocab_size, None)
        inputs = [tokens["tokens"] if is_first else torch.empty_like(boundary).requires_grad_() for _ in range(2)]
        grad = None if is_last else torch.empty_like(boundary)

    def forward(x):
        out = part(x, labels=labels) if own_loss else part(x)
        return out, loss(out, labels) / share if is_last else None, x

    def backward(run) -> None:
        out, value, x = run
        stage.backward_maybe_with_nosync("full", {"stage_output": value if is_last else (out,),
                                                  "output_grads": None if is_last else (grad,),
                                                  "input_values": [] if is_first else [x]})
        if not is_first:
            x.grad = None  # the receive buffer's gradient: counted by the schedule's timeline instead

    phases: list[int] = []
    with counting(fake, part) as meter, loss_context(step.loss_parallel):
        hooks = _phase_marks([getattr(part, stack)[key] for stack in spec.blocks for key in getattr(part, stack)],
                             meter, phases)
        meter.track(list(part.parameters()) + list(part.buffers()))
        base = meter.current
        runs = [forward(inputs[0])]
        one = meter.current
        runs.append(forward(inputs[1]))
        two = meter.current

        def backward_phases(start: int) -> tuple[int, ...]:
            """The next backward's phases (the loss and the last block, the middle, the first block and after), as
            bytes needed beyond what was live when it started."""
            phases.clear()
            meter.reset_peak()
            backward(runs.pop())
            phases.append(meter.peak)
            return tuple(p - start for p in phases[-3:])

        first = backward_phases(two)  # the step's first backward: no gradients yet
        with_grads = meter.current
        transient = backward_phases(with_grads)
        after = meter.current
        meter.reset_peak()
        stage.perform_reduce_grad(1)
        for hook in hooks:
            hook.remove()
        return StageTrace(params=base, optimizer=optimizer_bytes(part, cfg.optimizer.state_dtype),
                          grads=with_grads - one, act=two - one,
                          peak=0, transient=max(transient), first=max(first), end=meter.peak - after,
                          comm=meter.comm_peak, io=boundary.numel() * boundary.element_size(),
                          first_phases=first, transient_phases=transient)
