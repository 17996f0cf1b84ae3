"""Process group, device and DeviceMesh, chosen at runtime: CUDA + NCCL when present, else CPU + gloo."""

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.parallel.dims import ParallelDims

T = TypeVar("T")


@dataclass
class CollectiveTimeout:
    """The collective timeout in force, and the option that set it (for the message when it ends a run)."""
    seconds: int = 600
    key: str = "comm.init_timeout_seconds"


@dataclass
class World:
    rank: int
    local_rank: int
    size: int
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh | None  # None for a single process
    # Flattened axes: "dp" (replicate x shard), "dp_shard_cp", "dp_cp"; for MoE layers "routing" (every rank
    # of a stage that routes its own tokens: dp x cp x tp), "ep" (shard_in_ep x cp x tp), and for the FSDP
    # of router and experts "moe_shard" (shard x cp x tp) and "expert_shard" (shard_mod_ep, not flattened).
    flat: dict[str, DeviceMesh] = field(default_factory=dict)
    timeout: CollectiveTimeout = field(default_factory=CollectiveTimeout)  # its process groups'

    @property
    def dp_rank(self) -> int:
        return self.flat["dp"].get_local_rank() if self.mesh is not None and self.dims.dp > 1 else 0

    def dp_mesh(self) -> DeviceMesh | None:
        """Mesh FSDP works over: data-parallel ranks and context-parallel ranks (which see the same weights),
        2D (replicate, shard x cp) for HSDP, else 1D."""
        if self.mesh is None or self.dims.dp * self.dims.cp == 1:
            return None
        if self.dims.dp_replicate > 1:  # HSDP; with shard x cp = 1 it is plain replication (DDP)
            return self.mesh["dp_replicate", "dp_shard_cp"]
        return self.flat["dp_shard_cp"]

    def moe_mesh(self, experts: bool) -> DeviceMesh | None:
        """Mesh FSDP shards a MoE layer's routed experts (`experts`) or its router and shared experts over,
        when it is not dp_mesh(): TP ranks route different tokens (their sequence slices), so for these
        parameters they are data parallel; EP ranks hold different experts, so for those they are not. (EP
        takes in whole TP groups: then the 2D mesh FSDP forms with EP's keeps the root mesh's axis order.)"""
        if self.mesh is None or (self.dims.tp == 1 and not (experts and self.dims.ep > 1)):
            return None
        shard = self.mesh["dp_shard_mod_ep"] if experts and self.dims.ep > 1 else self.flat["moe_shard"]
        return _joined(self.mesh["dp_replicate"], shard) if self.dims.dp_replicate > 1 else shard


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_world(dims: ParallelDims, timeout_s: int = 600) -> World:
    """Start the process group (if launched with several ranks) and build one mesh with every axis."""
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        # Ranks on one host share its cores; oversubscribed threads thrash.
        if "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if dims.world_size == 1:
        return World(0, 0, 1, device, dims, None, timeout=CollectiveTimeout(timeout_s))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    world = mesh_world(dims, rank, local_rank, device)
    world.timeout.seconds = timeout_s
    return world


def mesh_world(dims: ParallelDims, rank: int, local_rank: int, device: torch.device) -> World:
    """The World over the process group already started (tessera.estimate's is a fake one): one mesh, every axis."""
    # Under EP the shard axis splits in two: the ranks outside one EP group, and those inside it.
    shard = [("dp_shard_mod_ep", dims.dp_shard // dims.shard_in_ep), ("dp_shard_in_ep", dims.shard_in_ep)] \
        if dims.ep > 1 else [("dp_shard", dims.dp_shard)]
    axes = [("pp", dims.pp), ("dp_replicate", dims.dp_replicate), *shard, ("cp", dims.cp), ("tp", dims.tp)]
    names, sizes = zip(*axes, strict=True)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
    s = tuple(n for n, _ in shard)
    groups = {"dp": ("dp_replicate", *s), "dp_shard_cp": (*s, "cp"), "dp_cp": ("dp_replicate", *s, "cp"),
              "routing": ("dp_replicate", *s, "cp", "tp"), "moe_shard": (*s, "cp", "tp")}
    if dims.ep > 1:
        groups["ep"] = ("dp_shard_in_ep", "cp", "tp")
    flat = {name: mesh[axes_]._flatten(name) for name, axes_ in groups.items()}
    return World(rank, local_rank, dims.world_size, device, dims, mesh, flat)


def set_timeout(world: World, seconds: int, key: str) -> None:
    """Every process group's collective timeout, the mesh's groups included (`key`: the option that set it)."""
    world.timeout.seconds, world.timeout.key = seconds, key
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def timeout_message(error: BaseException, timeout: CollectiveTimeout) -> str | None:
    """For a collective that waited past `timeout` (gloo raises a RuntimeError saying so), why and what to do."""
    if not (isinstance(error, RuntimeError) and "timed out" in str(error).lower()):
        return None
    return (f"a collective waited longer than {timeout.key} = {timeout.seconds} s: another rank is stuck or gone "
            f"(its log says which), or the wait is legitimately longer (raise {timeout.key})")


def _joined(replicate: DeviceMesh, shard: DeviceMesh) -> DeviceMesh:
    """The 2D (replicate, shard) mesh HSDP takes."""
    return DeviceMesh._concatenate([replicate, shard])


def on_rank0(fn: Callable[[], T]) -> T:
    """fn() on rank 0 only (a file-system check or look-up), its result or its exception on every rank."""
    result = error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    if dist.is_initialized():
        box = [result, error]
        dist.broadcast_object_list(box, src=0)
        result, error = box
    if error is not None:
        raise error
    return result


def shutdown(clean: bool) -> None:
    """After a clean run every rank meets once more first: gloo aborts a process now and then when one
    rank closes its connections while a peer still has traffic on them."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
