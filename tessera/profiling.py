"""The `[profiling]` section: torch.profiler traces on a schedule, one file per rank; memory snapshots (CUDA's
allocator history, or on CPU the profiler's memory timeline); and a CUDA snapshot when a run dies out of memory."""

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator

import torch

from tessera.config import JobConfig

log = logging.getLogger("tessera")


def _folder(cfg: JobConfig, sub: str, step: int) -> str:
    path = os.path.join(cfg.job.dump_folder, sub, f"iteration_{step}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def profiled(cfg: JobConfig, rank: int, device: torch.device, first_step: int) -> Iterator[Callable[[], None]]:
    """Yields the callable the step loop calls after each step. Of every `profile_freq` steps the last is
    recorded, the two before it warm the profiler up."""
    p = cfg.profiling
    cuda_history = p.enable_memory_snapshot and device.type == "cuda"
    if not (p.enable_profiling or p.enable_memory_snapshot):
        yield lambda: None
        return
    if cuda_history:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    step = [first_step]

    def on_trace(prof: torch.profiler.profile) -> None:
        if p.enable_profiling:
            path = os.path.join(_folder(cfg, p.save_traces_folder, step[0]), f"rank{rank}_trace.json")
            prof.export_chrome_trace(path)
            log.info(f"profiler trace of step {step[0]}: {path}")
        if p.enable_memory_snapshot and not cuda_history:
            path = os.path.join(_folder(cfg, p.save_memory_snapshot_folder, step[0]), f"rank{rank}_memory.html")
            with warnings.catch_warnings():  # deprecated for CUDA's allocator history, which CPU has not
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(path, device=str(device))

    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cpu_memory = p.enable_memory_snapshot and not cuda_history  # the timeline needs shapes, memory and stacks
    # Cycles of profile_freq steps (wait, warm-up, record), the first one cut so records land on multiples of it.
    schedule = torch.profiler.schedule(skip_first=-first_step % p.profile_freq, wait=p.profile_freq - 2, warmup=1,
                                       active=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace,
                                record_shapes=cpu_memory, profile_memory=cpu_memory, with_stack=cpu_memory) as prof:
        def after_step() -> None:
            step[0] += 1
            prof.step()
            if cuda_history and step[0] % p.profile_freq == 0:
                dump_cuda_snapshot(cfg, rank, f"iteration_{step[0]}")
        try:
            yield after_step
        finally:
            if cuda_history:
                torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_snapshot(cfg: JobConfig, rank: int, name: str) -> None:
    """The allocator's history so far, for pytorch.org/memory_viz (`name`: iteration_N, or oom)."""
    folder = os.path.join(cfg.job.dump_folder, cfg.profiling.save_memory_snapshot_folder, name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}_memory_snapshot.pickle")
    torch.cuda.memory._dump_snapshot(path)
    log.info(f"memory snapshot: {path}")
