"""Fault tolerance across replica groups (torchft, gloo on CPU): parity with HSDP, a group killed and rejoining
from a live peer, refusals, and a whole-job restart. Each replica group is its own launch, as in a real job."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import replica_groups as local
from tests.launch import TINY, merge, read_metrics, run_dist
from tests.replica_groups import kill, wait_for

pytestmark = pytest.mark.ranks  # every test here starts ranks

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side reads it once, when torchft is first imported
pytest.importorskip("torchft")

STEPS = 6


@pytest.fixture
def lighthouse():
    """A lighthouse on 127.0.0.1 with a free port; quick to notice a dead group (2 s without heartbeats)."""
    server, address = local.start_lighthouse()
    yield address
    server.shutdown()


def test_lighthouse_keeps_quiet(capfd):
    """The lighthouse logs each quorum at INFO: only its warnings reach the test output."""
    server, _ = local.start_lighthouse()
    time.sleep(0.2)
    server.shutdown()
    assert "[INFO]" not in capfd.readouterr().err


def ft_flags(address: str, replica_id: int, group_size: int = 2, min_size: int = 1) -> list[str]:
    return [*local.ft_flags(address, replica_id, group_size, min_size), "--fault_tolerance.log_state_digest",
            "--fault_tolerance.timeout_seconds", "20"]


def start_group(nproc: int, dump: Path, *args: str) -> subprocess.Popen:
    """One replica group: its own torchrun launch."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tessera.train", *merge(TINY, ["--job.dump_folder", str(dump)], args)]
    return local.start_process(cmd, dump.parent / f"{dump.name}-{time.monotonic_ns()}.log")


def finish(proc: subprocess.Popen, timeout: int = 240, expect: int = 0) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill(proc)
    out = proc.log.read_text()
    assert proc.returncode == expect, out[-4000:]
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


def start_single(dump: Path, *args: str, delay: float = 0.15, **faults: str) -> subprocess.Popen:
    """A replica group of one process (quick to start and to kill), each step slowed by `delay` seconds; `faults`:
    tests/faults.py's other settings."""
    return local.start_single(merge(TINY, ["--job.dump_folder", str(dump)], args),
                              dump.parent / f"{dump.name}-{time.monotonic_ns()}.log",
                              program=(str(local.ROOT / "tests/faults.py"),), TESSERA_TEST_STEP_SECONDS=str(delay),
                              **faults)


def rows(dump: Path, replica_id: int) -> list[dict]:
    return local.rows(dump / f"replica_{replica_id}")


@pytest.mark.paced
def test_killed_group_rejoins_from_a_live_peer_and_too_few_groups_stop_committing(tmp_path, lighthouse):
    """Three groups, min_replica_size 2. Group 2 is SIGKILLed at a random step: 0 and 1 go on, committing every
    step; relaunched, it recovers from a live peer and from then on holds their state bit for bit. Then 1 and 2 die:
    group 0 alone is below min_replica_size and commits nothing until group 1 is back (recovered). Group 2's steps
    are paced until its kill; the order of the rest is made to happen (tests/faults.py's TESSERA_TEST_HOLD): the
    three start once all heartbeat, groups 0 and 1 wait after step kill_at + 7 until the relaunched group 2 waits in
    its quorum, and every group after step kill_at + 11 until 1 and 2 are killed."""
    import random

    seed = random.randrange(1 << 30)
    kill_at = random.Random(seed).randint(3, 8)
    back_at, alone_at = kill_at + 8, kill_at + 12
    steps, dump = 150, tmp_path / "job"
    args = ["--training.steps", str(steps), "--optimizer.lr", "3e-3"]
    flags = [ft_flags(lighthouse, i, group_size=3, min_size=2) for i in range(3)]
    hold = {name: f"{at}:{tmp_path / name}" for name, at in
            (("go", 1), ("back", back_at), ("alone", alone_at), ("never", kill_at + 2))}  # never: group 2's bound
    procs = [start_single(dump, *args, *flags[i], delay=0.0,
                          TESSERA_TEST_HOLD=f"{hold['go']},{hold['back']},{hold['alone']}") for i in range(2)]
    procs.append(start_single(dump, *args, *flags[2], TESSERA_TEST_HOLD=f"{hold['go']},{hold['never']}"))
    survivor_step = lambda: rows(dump, 0)[-1]["step"] if rows(dump, 0) else 0  # noqa: E731
    try:
        wait_for("every group heartbeats", lambda: local.lighthouse_counts(lighthouse)[1] == 3, procs)
        (tmp_path / "go").touch()
        wait_for("first steps", lambda: survivor_step() >= kill_at, procs)
        kill(procs[2])
        killed_at = rows(dump, 2)[-1]["step"] if rows(dump, 2) else 0
        wait_for("survivors held", lambda: survivor_step() == back_at - 1, procs[:2])
        procs[2] = start_single(dump, *args, *flags[2], delay=0.0, TESSERA_TEST_HOLD=hold["alone"])
        rejoined = len(rows(dump, 2))
        wait_for("the relaunched group waits in its quorum", lambda: local.lighthouse_counts(lighthouse)[0] == 1,
                 procs)
        (tmp_path / "back").touch()
        wait_for("the killed group rejoins", lambda: len(rows(dump, 2)) > rejoined + 2, procs)
        wait_for("every group held", lambda: min(rows(dump, g)[-1]["step"] for g in range(3)) == alone_at - 1,
                 procs)
        kill(procs[1])
        kill(procs[2])
        (tmp_path / "alone").touch()
        stalled = survivor_step()
        time.sleep(4)  # group 0 alone: below min_replica_size 2
        assert survivor_step() <= stalled + 1, f"seed {seed}: a group alone kept committing"
        lives = {2: rejoined, 1: len(rows(dump, 1))}  # each group's rows before its relaunch
        procs[1] = start_single(dump, *args, *flags[1], delay=0.0)
        procs[0].wait(timeout=180)
        procs[1].wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill(proc)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, procs[0].log.read_text()[-3000:]
    a = rows(dump, 0)
    # Never restarted, every step committed once (a group that starts later than the others catches up first).
    assert [r["step"] for r in a] == list(range(a[0]["step"], steps + 1)), f"seed {seed}: group 0 restarted"
    after_kill = [r for r in a if r["step"] > killed_at]
    assert after_kill[0]["ft/recoveries"] == a[-1]["ft/recoveries"] <= 1  # it recovered nothing after the kill
    assert next(r for r in a if r["step"] == killed_at + 3)["ft/quorum"] == 2
    assert a[-1]["ft/quorum"] == 2 and a[-1]["ft/degraded_steps"] > 0
    losses = [r["loss"] for r in a]
    assert sum(losses[-10:]) < sum(losses[:10]) - 0.5, f"seed {seed}: the survivor's loss did not keep falling"
    assert "not committed (quorum 1 group(s), below fault_tolerance.min_replica_size 2)" in procs[0].log.read_text()
    assert "| run (fault tolerance) |" in (dump / "replica_0" / "report.md").read_text()
    digest = {r["step"]: r["ft/state_digest"] for r in a}
    for group in (1, 2):
        before, back = rows(dump, group)[:lives[group]], rows(dump, group)[lives[group]:]
        assert back and back[0]["ft/recoveries"] == 1, f"seed {seed}: group {group} did not recover from a peer"
        # Its data position came from the peer: every sample of its first step back (the step's global batch
        # before the position it reached) lies past every sample it trained before.
        assert back[0]["step"] > before[-1]["step"]
        assert back[0]["ft/sample_index"] - 3 * 8 >= before[-1]["ft/sample_index"]  # 3 groups x local batch 8
        assert all(r["ft/state_digest"] == digest[r["step"]] for r in before + back if r["step"] in digest), group
    assert "recovered step" in procs[2].log.read_text()


def test_whole_job_restart_resumes_the_checkpoint_exactly(tmp_path, lighthouse):
    """Two groups train 6 steps, saving at 3 and 6 (group 0 alone writes); with step 6 gone, the whole job is
    relaunched: both groups resume step 3 from disk and repeat steps 4-6 bit for bit."""
    dump = tmp_path / "job"
    args = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
            "--checkpoint.last_save_model_only", "false"]

    def run_job() -> list[str]:
        procs = [start_single(dump, *args, *ft_flags(lighthouse, i, min_size=2), delay=0.0) for i in range(2)]
        return [finish(proc) for proc in procs]

    first = run_job()
    assert "checkpoint step 3 saved" in first[0] and "checkpoint step" not in first[1]  # one group saves
    import shutil
    shutil.rmtree(dump / "checkpoint" / "step-6")
    reference = {i: {r["step"]: r for r in rows(dump, i)} for i in range(2)}
    second = run_job()
    for i in range(2):
        assert "resumed from checkpoint step 3" in second[i]
        again = rows(dump, i)[-3:]
        assert [r["step"] for r in again] == [4, 5, 6]
        for r in again:
            assert (r["loss"], r["grad_norm"], r["ft/state_digest"]) == \
                (reference[i][r["step"]]["loss"], reference[i][r["step"]]["grad_norm"],
                 reference[i][r["step"]]["ft/state_digest"])


@pytest.mark.paced
def test_two_jobs_on_one_lighthouse_do_not_mix(tmp_path, lighthouse):
    """Job A trains alone; job B (another seed, its own folder, also replica 0 of 2) joins the same lighthouse: B is
    refused in one line before it copies anything from A; A commits only steps whose quorum is itself, and goes on."""
    args = ["--training.steps", "1000"]
    job_a = start_single(tmp_path / "a", *args, *ft_flags(lighthouse, 0), "--training.seed", "1")
    job_b = job_a
    try:
        wait_for("job A's first steps", lambda: len(rows(tmp_path / "a", 0)) >= 2, [job_a])
        job_b = start_single(tmp_path / "b", *args, *ft_flags(lighthouse, 0), "--training.seed", "2", delay=0.0)
        job_b.wait(timeout=120)
        after_b = len(rows(tmp_path / "a", 0))
        wait_for("job A goes on", lambda: len(rows(tmp_path / "a", 0)) >= after_b + 3, [job_a])
    finally:
        for proc in (job_a, job_b):
            if proc.poll() is None:
                kill(proc)
    out_b = job_b.log.read_text()
    assert job_b.returncode == 2, out_b[-3000:]
    assert "tessera: fault_tolerance: the live replica group this group would recover from runs job 'cfg-" in out_b
    assert "recovered step" not in out_b and not rows(tmp_path / "b", 0)
    a = rows(tmp_path / "a", 0)
    assert [r["step"] for r in a] == list(range(1, len(a) + 1)) and {r["ft/quorum"] for r in a} == {1}


def _refused(capsys, *args: str) -> str:
    from tessera.train import main

    assert main(merge(TINY, args)) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_input_is_refused_in_one_line(tmp_path, lighthouse, capsys):
    from tessera.config import parse_args
    from tessera.ft import check
    from tessera.preflight import validate

    dump = ["--job.dump_folder", str(tmp_path)]
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert _refused(capsys, *dump, *ft_flags(closed, 0)).startswith(
        f"tessera: fault_tolerance.lighthouse: no lighthouse answers at {closed} (")
    assert _refused(capsys, *dump, *ft_flags("not a url", 0)) == (
        "tessera: fault_tolerance.lighthouse: 'not a url' is not a lighthouse address (it holds a space or control "
        "character); give http://HOST:PORT (or HOST:PORT), e.g. http://lighthouse-host:29510")
    assert "'ftp://127.0.0.1:29510' is not a lighthouse address (scheme 'ftp': the lighthouse speaks http)" in \
        _refused(capsys, *dump, *ft_flags("ftp://127.0.0.1:29510", 0))
    assert _refused(capsys, *dump, *ft_flags(lighthouse, 2)) == ("tessera: fault_tolerance.replica_id: 2 is not below "
                                                                 "group_size 2; number the replica groups 0 .. 1")
    assert _refused(capsys, *dump, *ft_flags(lighthouse, 0, min_size=3)).startswith(
        "tessera: fault_tolerance.min_replica_size: 3 is more than group_size 2")
    # A running group 0 (its lock held here, as its rank 0 holds it), with its files.
    running = validate(parse_args(merge(TINY, dump, ft_flags(lighthouse, 0))), 1).cfg  # as its ranks run it
    held = check.check_live(running, 1, hold=True)
    try:
        record = tmp_path / "replica_0" / "metrics.jsonl"
        record.write_text('{"step": 1}\n')
        assert _refused(capsys, *dump, *ft_flags(lighthouse, 0)) == (
            f"tessera: fault_tolerance.replica_id: 0 is already running ({socket.gethostname()} pid {os.getpid()}); "
            f"give each live replica group its own id, 0 .. 1")
        assert _refused(capsys, *dump, *ft_flags(lighthouse, 1), "--model.flavor", "debugmodel") == (
            "tessera: fault_tolerance: replica group 0 (running) has model.flavor = 'tiny', this group 'debugmodel'; "
            "every group runs the same config and layout, only fault_tolerance.replica_id differs")
        assert _refused(capsys, *dump, *ft_flags(lighthouse, 1), "--training.local_batch_size", "4").startswith(
            "tessera: fault_tolerance: replica group 0 (running) has training.local_batch_size = 8, this group 4")
        assert record.read_text() == '{"step": 1}\n' and not (tmp_path / "replica_1" / "metrics.jsonl").exists()
    finally:
        check.release(held)
