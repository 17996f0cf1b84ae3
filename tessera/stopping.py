"""Ending a run early at a step boundary every rank agrees on, losing no step.

A scheduler asks a job to stop with a signal before it kills it: SLURM at a time limit (`--signal`) or a
preemption, Kubernetes on eviction, torchrun forwarding what it got. The signals named in
`checkpoint.save_on_signal` (SIGTERM by default) only mark the request here; at the next step boundary the ranks
agree on it with one small CPU collective (so they stop at the same step even when only some got the signal), the
run saves a full checkpoint of that step and exits with REQUEUE_EXIT. A signal repeated while the run stops (SLURM
signals every process of a step, and torchrun forwards its own copy) changes nothing: the save goes on, and a kill
during it leaves a folder without its `.complete` marker, which no resume counts.

The same collective carries a failed checkpoint save (an async one fails in the background; rank 0 alone writes
the marker), so every rank stops at the same boundary with it too.
"""

import contextlib
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

# 128 + SIGTERM: the status of a process ended by SIGTERM, which SLURM (RequeueExit, or the batch script's
# `scontrol requeue`), Kubernetes and torchrun read as "terminated, not failed". Used whichever signal asked.
REQUEUE_EXIT = 128 + signal.SIGTERM


def children(parent: int | None = None) -> list[int]:
    """The live processes `parent` (this one) started, from /proc: torchrun's ranks."""
    parent, found = parent or os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{entry}/stat") as fh:
                state, ppid = fh.read().rsplit(")", 1)[1].split()[:2]
                if int(ppid) == parent and state != "Z":
                    found.append(int(entry))
    return found


def peer_gone() -> bool:
    """Whether a rank torchrun started beside this one has ended (torchrun then sends SIGTERM to the rest)."""
    started = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return started > 1 and os.path.isdir("/proc") and len(children(os.getppid())) < started


class Stopped(Exception):
    """The run stopped on a signal after saving the step it reached: exit with REQUEUE_EXIT."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (checkpoint.space.save_failure says why, in one line): the run stops."""


class StopRequest:
    """The signals asked for, received by this process (the first one kept), and agreed on by every rank at
    step boundaries (`agree`)."""

    def __init__(self, names: list[str], world_size: int):
        # Handlers belong to the main thread: a run started from another one (a notebook's worker) keeps the
        # signals' own actions.
        main = threading.current_thread() is threading.main_thread()
        self.signals = [getattr(signal, name) for name in names] if main else []
        self.received: int = 0  # the first signal's number; 0 = none
        self.received_at: float | None = None  # when (time.monotonic()) this process got it
        # A CPU group of its own: the agreement never enters the GPU queue, nor races the checkpointer's group.
        self.group = dist.new_group(backend="gloo") if world_size > 1 and dist.is_initialized() else None
        self.previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if peer_gone():  # torchrun ending the other ranks after one failed: nothing to save, go at once
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if not self.received:  # a repeated signal (SLURM and torchrun both send one) is the same
            self.received, self.received_at = signum, time.monotonic()

    def agree(self, save_failed: bool) -> tuple[str | None, bool]:
        """At a step boundary, on every rank: (the signal some rank got, by name, or None; whether some rank's
        checkpoint save failed)."""
        flags = torch.tensor([self.received, int(save_failed)], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        received, failed = int(flags[0]), bool(flags[1])
        return (signal.Signals(received).name if received else None), failed

    def first_message(self, local: str | None) -> str | None:
        """The first rank's (in rank order) of the ranks' `local` messages: one line for the whole job."""
        if self.group is None:
            return local
        found = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(found, local, group=self.group)
        return next((m for m in found if m), None)

    def __enter__(self) -> "StopRequest":
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
