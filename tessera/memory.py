"""Live tensor bytes: every tensor storage alive at once, counted op by op, and its peak. The same count serves
a run (`metrics.live_memory`: the `live_peak_gib` metric, real tensors) and `tessera.estimate` (fake tensors on a
fake process group), so a step's estimate and its measurement count the same things: parameters, gradients,
optimizer state, saved activations, communication buffers and temporaries, each storage once however many
views share it, from its allocation until it is freed (FSDP frees gathered parameters by resizing their storage
to 0: that is counted too). Allocator rounding and fragmentation are not: on a GPU the allocator's peak is a
little higher."""

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401 - registers the fsdp ops named below
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Inside it, every op's outputs are counted until their storage dies; `track(tensors)` counts tensors made
    before (parameters, buffers). `current` and `peak` are bytes; `reset_peak()` starts a new window for `peak`.
    `comm_current` and `comm_peak` (over the whole count) are those of communication buffers alone (FSDP's
    all-gather and reduce-scatter buffers, EP's all-to-all outputs)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list] = {}  # id(storage) -> [weak reference, bytes, a collective's output]
        self.current = self.peak = self.comm_current = self.comm_peak = 0
        self._fake_mode = self._resize = self._lock = None
        self._paused = 0

    def track(self, *objs) -> None:
        for obj in objs:
            for t in tree_leaves(obj):
                if isinstance(t, torch.Tensor):
                    for st in get_untyped_storages(t):
                        self._add(st)
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, st: torch.UntypedStorage, comm: bool = False) -> None:
        key = id(st)
        if key in self.live:
            return
        nbytes = st.nbytes()
        self.live[key] = [weakref.ref(st, lambda _, k=key: self._free(k)), nbytes, comm]
        self._count(nbytes, comm)

    def _count(self, nbytes: int, comm: bool) -> None:
        self.current += nbytes
        if comm:
            self.comm_current += nbytes
            self.comm_peak = max(self.comm_peak, self.comm_current)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self._count(-entry[1], entry[2])

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self.live.get(id(st))
        if entry is not None and entry[0]() is st:
            self._count(st.nbytes() - entry[1], entry[2])
            entry[1] = st.nbytes()
            self.peak = max(self.peak, self.current)

    def __enter__(self):
        self._fake_mode = active_fake_mode()
        # Storage.resize_ is no op a dispatch mode sees; FSDP frees and refills gathered parameters with it.
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            out = original(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        # DTensor runs each new op once on fake tensors to learn its output's shape, under the fake mode in force
        # (the estimate's own): nothing a rank allocates. Its lock around that run is where counting pauses.
        # torch 2.11 has no such lock (2.13 has): there each of those outputs is counted while it lives.
        self._lock = getattr(ShardingPropagator, "_fake_mode_lock", None)
        if self._lock is not None:
            ShardingPropagator._fake_mode_lock = _Pause(self, self._lock)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        if self._lock is not None:
            ShardingPropagator._fake_mode_lock = self._lock
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):  # let DTensor run its local ops, which are counted
            return NotImplemented
        if self._paused:
            return func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            out = args[0]  # fake tensors' wait returns a new tensor; a real wait returns its input
        else:
            out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops under a fake mode of its own: those allocate nothing.
        if active_fake_mode() is self._fake_mode:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    for st in get_untyped_storages(t):
                        self._add(st)
            for t in _comm_buffers(func, kwargs, out):
                for st in get_untyped_storages(t):
                    self._mark_comm(st)
            self.peak = max(self.peak, self.current)
        return out

    def _mark_comm(self, st: torch.UntypedStorage) -> None:
        entry = self.live.get(id(st))
        if entry is not None and not entry[2]:
            entry[2] = True
            self.comm_current += entry[1]
            self.comm_peak = max(self.comm_peak, self.comm_current)


class _Pause:
    def __init__(self, meter: LiveBytes, lock):
        self.meter, self.lock = meter, lock

    def __enter__(self):
        self.lock.__enter__()
        self.meter._paused += 1

    def __exit__(self, *exc):
        self.meter._paused -= 1
        return self.lock.__exit__(*exc)


def _comm_buffers(func, kwargs: dict | None, out) -> list[torch.Tensor]:
    """The buffers an op fills for communication: FSDP's all-gather buffer, the gradients it concatenates for a
    reduce-scatter, and what an all-to-all returns (expert parallelism's tokens). (TP's and CP's gathered tensors
    are activations that backward keeps; a reduce-scatter's output becomes the gradient shard.)"""
    if func in _ALL_TO_ALL or func is torch.ops.fsdp.all_gather_copy_in.default:
        return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if func is torch.ops.fsdp.chunk_cat.default:
        return [kwargs["out"]]
    return []


_ALL_TO_ALL = (torch.ops._c10d_functional.all_to_all_single.default, torch.ops.c10d.alltoall_base_.default)


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list:
    """The tensors a model and its optimizer hold between steps."""
    held = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if optimizer is not None:
        held += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return held


@contextlib.contextmanager
def live_memory(tr):
    """For `metrics.live_memory`: count the run's live bytes on this rank while training (slower: a Python
    call per op) with tr.live_bytes (built with the trainer). Entered once for the whole loop, so buffers a
    schedule allocates in its first step count."""
    if tr.live_bytes is None:
        yield
        return
    with tr.live_bytes:
        for part in tr.step_parts.pipeline.parts if tr.step_parts.pipeline is not None else [tr.step_parts.model]:
            tr.live_bytes.track(model_state(part, tr.optimizer))
        yield


def live_memory_metrics(tr) -> dict[str, float]:
    """{"live_peak_gib": the largest rank's peak of live bytes since the last log}, and a new window."""
    if tr.live_bytes is None:
        return {}
    peak = torch.tensor(float(tr.live_bytes.peak), device=tr.world.device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tr.live_bytes.reset_peak()
    return {"live_peak_gib": peak.item() / 2**30}
