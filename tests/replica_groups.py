"""Replica groups on this machine, as separate processes (for the tests and benchmarks/bench_ft.py): a
lighthouse in this process, groups of one process started without torchrun (each starts its own store)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_lighthouse(heartbeat_timeout_ms: int = 2000):
    """(server, address): a lighthouse on 127.0.0.1 with a free port, forming a quorum of whoever is live and
    dropping a group after `heartbeat_timeout_ms` without heartbeats."""
    os.environ.setdefault("RUST_LOG", "warn")  # it logs each quorum otherwise; read when torchft is first imported
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, quorum_tick_ms=20,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    return server, f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"


def start_lighthouse_process(folder: Path, *flags: str):
    """(process, address): `python -m tessera.lighthouse` (the one ft_trainer.slurm starts), on a free port."""
    proc = start_process([sys.executable, "-m", "tessera.lighthouse", "--bind", "[::]:0", "--quorum_tick_ms", "20",
                          "--heartbeat_timeout_ms", "2000", *flags], folder / f"lighthouse-{time.monotonic_ns()}.log")
    wait_for("the lighthouse", lambda: "serving at" in proc.log.read_text(), [proc], 60)
    port = proc.log.read_text().split("serving at ")[1].split()[0].rsplit(":", 1)[1]
    return proc, f"http://127.0.0.1:{port}"


def lighthouse_counts(address: str) -> tuple[int, int]:
    """(groups waiting in a quorum request, groups heartbeating) at the lighthouse now, from its status page (torchft
    0.2.0: "[N/M participants healthy][K heartbeating]"). A test holds a group at a step (tests/faults.py's
    TESSERA_TEST_HOLD) and lets it go once the other waits in its quorum request: the lighthouse's next quorum, the
    held group's next, then holds both, whatever their speeds."""
    with urllib.request.urlopen(f"{address}/status", timeout=10) as page:
        found = re.search(r"\[(\d+)/\d+ participants healthy\]\[(\d+) heartbeating\]", page.read().decode())
    assert found, f"the lighthouse at {address} no longer says its participants on /status (torchft's page changed)"
    return int(found.group(1)), int(found.group(2))


def ft_flags(address: str, replica_id: int, group_size: int, min_size: int = 1) -> list[str]:
    return ["--fault_tolerance.enable", "--fault_tolerance.lighthouse", address, "--fault_tolerance.replica_id",
            str(replica_id), "--fault_tolerance.group_size", str(group_size), "--fault_tolerance.min_replica_size",
            str(min_size)]


def start_process(cmd: list[str], log: Path, drop: tuple[str, ...] = (), **env: str) -> subprocess.Popen:
    """`cmd` in its own session (kill() ends all of it), output in `log` (proc.log); `drop`: variables unset."""
    env = {k: v for k, v in {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}.items()
           if k not in drop}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    proc.log = log
    return proc


def start_single(argv: list[str], log: Path, program: tuple[str, ...] = ("-m", "tessera.train"),
                 **env: str) -> subprocess.Popen:
    """tessera.train (or `program`, which runs it: a script injecting faults) with `argv` as one process without
    torchrun."""
    return start_process([sys.executable, *program, *argv], log,
                         drop=("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"), **env)


def rows(folder: Path) -> list[dict]:
    """The training records of `folder`/metrics.jsonl so far ([] before the first)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line and '"validation/' not in line]


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process and every process under it at once, as a node failure would (torchrun starts its
    workers in sessions of their own)."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    # Until every one has exited, a file lock it holds (the group's replica-id lock) would refuse the relaunch.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids[1:]) and time.monotonic() < deadline:
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Running, not yet a zombie (a zombie holds no files)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def wait_for(what: str, predicate, procs, timeout: float = 90.0) -> float:
    """Seconds until predicate() holds; AssertionError naming `what` after `timeout`, or when a process ended."""
    start = time.monotonic()
    while not predicate():
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"{what}: a process ended early:\n{proc.log.read_text()[-3000:]}")
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - start
