"""Fault tolerance across replica groups (torchft, gloo on CPU): parity with HSDP, a group killed and rejoining
from a live peer, refusals, and a whole-job restart. Each replica group is its own launch, as in a real job."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.launch import ROOT, TINY, merge, read_metrics, run_dist

os.environ.setdefault("RUST_LOG", "warn")  # the in-process lighthouse logs each quorum otherwise
pytest.importorskip("torchft")

STEPS = 6


@pytest.fixture
def lighthouse():
    """A lighthouse on 127.0.0.1 with a free port; quick to notice a dead group (2 s without heartbeats)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, quorum_tick_ms=20,
                              heartbeat_timeout_ms=2000)
    yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    server.shutdown()


def ft_flags(address: str, replica_id: int, group_size: int = 2, min_size: int = 1) -> list[str]:
    return ["--fault_tolerance.enable", "--fault_tolerance.lighthouse", address, "--fault_tolerance.replica_id",
            str(replica_id), "--fault_tolerance.group_size", str(group_size), "--fault_tolerance.min_replica_size",
            str(min_size), "--fault_tolerance.log_state_digest", "--fault_tolerance.timeout_seconds", "20"]


def start_group(nproc: int, dump: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """One replica group: its own torchrun launch, in its own process group (so a test can kill all of it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tessera.train", *merge(TINY, ["--job.dump_folder", str(dump)], args)]
    log = dump.parent / f"{dump.name}-{time.monotonic_ns()}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, timeout: int = 240) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = proc.log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return out


def final_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = max(checkpoint.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    out = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(newest, out)
    return torch.load(out)["model"]


def test_two_groups_of_fsdp2_equal_hsdp_2x2(tmp_path, lighthouse):
    common = ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(STEPS)]
    groups = [start_group(2, tmp_path / "ft", *common, *ft_flags(lighthouse, i, min_size=2)) for i in range(2)]
    for proc in groups:
        finish(proc)
    ref = run_dist(4, tmp_path / "hsdp", *common, "--parallelism.data_parallel_replicate_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "2")
    runs = [read_metrics(tmp_path / "ft" / f"replica_{i}") for i in range(2)]
    assert [r["step"] for r in runs[0]] == [r["step"] for r in runs[1]] == list(range(1, STEPS + 1))
    for a, b, h in zip(*runs, ref, strict=True):
        assert a["ft/quorum"] == b["ft/quorum"] == 2 and a["ft/state_digest"] == b["ft/state_digest"]
        assert abs((a["loss"] + b["loss"]) / 2 - h["loss"]) < 1e-5  # each group's loss is the mean over its share
        assert abs(a["grad_norm"] - h["grad_norm"]) < 1e-5 and a["grad_norm"] == b["grad_norm"]
    got, want = final_weights(tmp_path / "ft" / "checkpoint"), final_weights(tmp_path / "hsdp" / "checkpoint")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)
