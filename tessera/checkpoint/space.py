"""Room for checkpoints: the check before any rank starts, and the one line a save that failed ends the run with.

Torch-free, so the launch pre-check can use it.
"""

import errno
import os
import shutil

from tessera.checkpoint.folder import resume_point

GiB = 2**30


def size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


def free_bytes(folder: str) -> int:
    """Free bytes where `folder` is (or would be created)."""
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def checkpoint_bytes(root: str, estimate: int) -> int:
    """What one more checkpoint takes: the newest complete one's size when it is a full one (a seed or a
    weights-only one holds a third of it), else `estimate`."""
    found = resume_point(root, content=False, report=False)
    return sum(found[2]["files"].values()) if found and found[2].get("kind") == "full" else estimate


def room_problem(root: str, need_bytes: int) -> str | None:
    """A line when `root` has no room for a checkpoint of `need_bytes`, else None."""
    free = free_bytes(root)
    if need_bytes <= free:
        return None
    return f"'{root}' has {size(free)} free, but one checkpoint of this run needs about {size(need_bytes)}"


def _causes(error: BaseException):
    """`error` and what it wraps: DCP's CheckpointException holds each failed rank's exception."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in getattr(e, "failures", {}).values() if isinstance(pair, tuple)]


def save_failure(step: int, path: str, root: str, error: BaseException, estimate: int) -> str:
    """One line for a checkpoint that could not be written (the partial folder already removed): the cause
    (a full disk named as such), the room there is and needs, the checkpoint kept, and what to do."""
    causes = list(_causes(error))
    full = next((e for e in causes if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)
    last = causes[-1] if len(causes) > 1 else error  # the innermost: the storage error, not DCP's wrapper
    cause = os.strerror(full.errno).lower() if full else f"{type(last).__name__}: {str(last).splitlines()[0]}" \
        if str(last) else type(last).__name__
    kept = resume_point(root, content=False, report=False)
    need = checkpoint_bytes(root, estimate)
    previous = f"the newest complete checkpoint, step {kept[0]}, is kept" if kept else "no earlier checkpoint exists"
    return (f"checkpoint step {step} could not be saved to {path} ({cause}; {size(free_bytes(root))} free "
            f"there, a checkpoint of this run needs about {size(need)}); {previous}. Training stops: free "
            f"some space (or lower checkpoint.keep_latest_k, or set checkpoint.folder on another disk) and relaunch"
            + (f" to resume from step {kept[0]}" if kept else ""))
