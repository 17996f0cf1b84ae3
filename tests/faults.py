"""`torchrun ... tests/faults.py [train flags]`: tessera.train with a fault injected, for tests of how runs end.

TESSERA_TEST_STALL="rank:step:seconds": that rank sleeps before that step (a stuck rank, for comm timeouts).
TESSERA_TEST_NAN_STEPS="3,4": those steps' gradients are NaN on every rank (for the non-finite policy).
TESSERA_TEST_STEP_SECONDS="0.5": every step takes that much longer (a run long enough to signal in mid-run).
TESSERA_TEST_HOLD="7:/tmp/go,12:/tmp/back": before step 7 (or the first step past it, for a group that recovered
    past it), this process waits until /tmp/go exists; before step 12 until /tmp/back. The test creates the file once
    what must come first has happened: an order between processes made to happen, not hoped for from their speeds.
TESSERA_TEST_SAVE_HOLD="5:/tmp/go": the shard writing of a checkpoint of step 5 or later waits until the file exists
    (to signal during a save).
TESSERA_TEST_KILL_BEFORE_MARKER="9": rank 0 is SIGKILLed once step 9's checkpoint is written, before its marker.
TESSERA_TEST_REFUSE_COMMIT="2": this process's 2nd torchft commit vote is no (a replica group's failed sync).
"""

import os
import re
import signal
import sys
import time

import torch

from tessera import train


def holds(spec: str) -> list[tuple[int, str]]:
    """TESSERA_TEST_HOLD's (step, file) pairs, in step order."""
    return sorted((int(step), path) for step, _, path in (item.partition(":") for item in spec.split(",") if item))


def wait_for_file(path: str) -> None:
    """Until `path` exists. A signal meanwhile runs its handler (the trainer's stop request) and the wait goes on."""
    while not os.path.exists(path):
        time.sleep(0.02)


def faulty(step_fn, stall: str = "", nan_steps: frozenset = frozenset(), step_seconds: float = 0.0,
           held: list[tuple[int, str]] | None = None):
    """`step_fn` (tessera.train.train_step) with the faults above."""
    held = list(held or [])

    def faulty_step(tr):
        while held and held[0][0] <= tr.progress.step + 1:
            wait_for_file(held.pop(0)[1])
        time.sleep(step_seconds)
        if stall:
            rank, step, seconds = (float(x) for x in stall.split(":"))
            if tr.world.rank == int(rank) and tr.progress.step + 1 == int(step):
                time.sleep(seconds)
        if tr.progress.step + 1 not in nan_steps:
            return step_fn(tr)
        clip = train.clip_grad_norm_

        def poisoned(params, *a, **kw):
            params = list(params)
            for p in params:
                p.grad.fill_(float("nan"))
            return clip(params, *a, **kw)
        train.clip_grad_norm_ = poisoned
        try:
            return step_fn(tr)
        finally:
            train.clip_grad_norm_ = clip
    return faulty_step


def held_writes(writer_class, step: int, path: str) -> None:
    """Each shard's writing (a DCP writer's write_data) of a checkpoint of `step` or later waits until `path` exists."""
    write_data = writer_class.write_data

    def held(self, plan, planner):
        if (m := re.search(r"step-(\d+)$", str(self.path))) and int(m.group(1)) >= step:
            wait_for_file(path)
        return write_data(self, plan, planner)
    writer_class.write_data = held


def refuse_commit(manager_class, vote: int) -> None:
    """The `vote`-th call of `manager_class.should_commit` (torchft's Manager) in this process says no."""
    should_commit, votes = manager_class.should_commit, []

    def refused(self, *args, **kwargs):
        votes.append(should_commit(self, *args, **kwargs))
        return votes[-1] and len(votes) != vote
    manager_class.should_commit = refused


def kill_before_marker(manager, step: int) -> None:
    """The process dies (SIGKILL) when it is about to mark step `step`'s checkpoint complete (`manager`:
    tessera.checkpoint.manager, whose rank 0 writes the marker)."""
    write_marker = manager.write_marker

    def killed(path, at, *args, **kwargs):
        if at == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return write_marker(path, at, *args, **kwargs)
    manager.write_marker = killed


if __name__ == "__main__":
    torch.set_num_threads(1)
    train.train_step = faulty(train.train_step, os.environ.get("TESSERA_TEST_STALL", ""),
                              frozenset(int(s) for s in os.environ.get("TESSERA_TEST_NAN_STEPS", "").split(",") if s),
                              float(os.environ.get("TESSERA_TEST_STEP_SECONDS", "0")),
                              holds(os.environ.get("TESSERA_TEST_HOLD", "")))
    if os.environ.get("TESSERA_TEST_SAVE_HOLD"):
        from tessera.checkpoint.writer import HashingWriter
        at, _, path = os.environ["TESSERA_TEST_SAVE_HOLD"].partition(":")
        held_writes(HashingWriter, int(at), path)
    if os.environ.get("TESSERA_TEST_KILL_BEFORE_MARKER"):
        from tessera.checkpoint import manager
        kill_before_marker(manager, int(os.environ["TESSERA_TEST_KILL_BEFORE_MARKER"]))
    if os.environ.get("TESSERA_TEST_REFUSE_COMMIT"):
        from torchft import Manager
        refuse_commit(Manager, int(os.environ["TESSERA_TEST_REFUSE_COMMIT"]))
    sys.exit(train.main(sys.argv[1:]))
