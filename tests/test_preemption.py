"""Stopping on a scheduler's signal with nothing lost (tessera/stopping.py), and saves that fail on a full disk.

The signal tests launch 2 ranks as SLURM and Kubernetes do (tessera.launch, CPU gloo) and signal them mid-run:
every process at once (SLURM signals each process of a job step), the launcher alone (Kubernetes; SLURM's
`--signal` reaches the launcher too), one rank alone, and a second SIGTERM while the stop's save is written.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tessera.checkpoint.folder import resume_point
from tessera.launch import children
from tessera.stopping import REQUEUE_EXIT
from tests.launch import ROOT, TINY, merge, read_metrics

STEPS = 12
FLAGS = ["--training.steps", str(STEPS), "--training.local_batch_size", "4", "--checkpoint.enable",
         "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]


def _launch(dump, *extra, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tessera.launch", "--standalone", "--nproc_per_node=2", str(ROOT / "tests/faults.py"),
           *merge(TINY, FLAGS, ["--job.dump_folder", str(dump)], extra)]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _signal_at(proc: subprocess.Popen, step: int, send, released, then=None) -> str:
    """Its output, `send(launcher pid, rank pids)` called once it logged `step`, then `released` created (ranks
    launched with TESSERA_TEST_HOLD=7:`released` wait before step 7 until then: the run stops at step 5, 6 or 7 however
    late this process reads its output, never at its end), then `then()`."""
    out = []
    for line in proc.stdout:
        out.append(line)
        if f"step {step:>2}/{STEPS}" in line:
            send(proc.pid, children(proc.pid))
            break
    released.touch()
    if then is not None:
        then()
    out.append(proc.stdout.read())
    proc.wait(timeout=120)
    return "".join(out)


def _stopped_step(out: str, dump) -> int:
    """The step the run says it stopped at, which its newest complete checkpoint (content checked) holds."""
    line = next(ln for ln in out.splitlines() if ln.startswith("tessera: stopped on SIGTERM after step"))
    step = int(line.split("after step ")[1].split()[0])
    assert line == (f"tessera: stopped on SIGTERM after step {step} of {STEPS}: checkpoint step {step} saved in "
                    f"{dump}/checkpoint; exit status {REQUEUE_EXIT} (relaunch, or let SLURM requeue, to resume)")
    newest = resume_point(str(dump / "checkpoint"))
    assert newest[0] == step and newest[2]["kind"] == "full"
    assert read_metrics(dump)[-1]["step"] == step and "Traceback" not in out, out[-3000:]
    return step


def _losses(dump) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(dump)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ref") / "run"
    proc = _launch(dump)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    return _losses(dump)


@pytest.mark.paced
def test_sigterm_to_every_process_saves_the_step_reached_and_the_relaunch_loses_nothing(tmp_path, uninterrupted):
    """SLURM's way: the launcher and each rank get SIGTERM (each rank then a second from the launcher) while an
    async save may be in flight; the relaunch's losses equal the uninterrupted run's."""
    def every_process(launcher, ranks):
        for pid in (launcher, *ranks):
            os.kill(pid, signal.SIGTERM)
    dump, released = tmp_path / "run", tmp_path / "signalled"
    run = _launch(dump, "--checkpoint.async_mode", "async", env={"TESSERA_TEST_HOLD": f"7:{released}"})
    out = _signal_at(run, 5, every_process, released)
    assert run.returncode == REQUEUE_EXIT, out[-3000:]
    step = _stopped_step(out, dump)
    assert 5 <= step <= 7
    again = _launch(dump, "--checkpoint.async_mode", "async")
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and f"resumed from checkpoint step {step} " in out, out[-3000:]
    assert _losses(dump) == uninterrupted  # the steps up to the stop, then the relaunch's: bit for bit


@pytest.mark.paced
def test_sigterm_to_the_launcher_only_and_again_during_the_save(tmp_path):
    """Kubernetes' way: only the launcher gets SIGTERM and passes it on; a second one arrives while the stop's
    checkpoint is written (held until then: tests/faults.py's TESSERA_TEST_SAVE_HOLD): the save completes and
    counts, once. (Paced steps: the launcher passes the first signal on well before the run could end.)"""
    dump, released, saved = tmp_path / "run", tmp_path / "signalled", tmp_path / "saved"
    in_progress = []

    def again_during_the_save():
        deadline = time.monotonic() + 60
        while not (saving := [p for p in (dump / "checkpoint").glob("step-*") if p.name != "step-4"]):
            assert time.monotonic() < deadline  # the stop's save has begun
            time.sleep(0.05)
        os.kill(run.pid, signal.SIGTERM)
        in_progress.append(not (saving[0] / ".complete").exists())
        saved.touch()
    run = _launch(dump, env={"TESSERA_TEST_STEP_SECONDS": "0.3", "TESSERA_TEST_HOLD": f"7:{released}",
                             "TESSERA_TEST_SAVE_HOLD": f"5:{saved}"})
    out = _signal_at(run, 5, lambda launcher, ranks: os.kill(launcher, signal.SIGTERM), released,
                     then=again_during_the_save)
    assert run.returncode == REQUEUE_EXIT, out[-3000:]
    assert out.count("tessera: stopped on SIGTERM") == 1 and in_progress == [True]
    _stopped_step(out, dump)


@pytest.mark.paced
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Only rank 1 gets it: the ranks agree at the next step boundary, save that step together, and exit."""
    dump, released = tmp_path / "run", tmp_path / "signalled"
    run = _launch(dump, env={"TESSERA_TEST_HOLD": f"7:{released}"})
    out = _signal_at(run, 5, lambda launcher, ranks: os.kill(max(ranks), signal.SIGTERM), released)
    assert run.returncode == REQUEUE_EXIT, out[-3000:]
    step = _stopped_step(out, dump)
    marker = json.loads((dump / f"checkpoint/step-{step}/.complete").read_text())
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(marker["files"])  # both ranks wrote that step


def test_sigusr1_when_asked_in_one_process(tmp_path, capsys, monkeypatch):
    """checkpoint.save_on_signal = SIGUSR1 (SLURM's `--signal=USR1@...`): the signal arrives inside step 3; the
    step finishes, is saved, and the run exits 143; a name that is no such signal is refused before the start."""
    from tessera import train

    step_fn = train.train_step

    def signalled(tr):
        if tr.progress.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return step_fn(tr)
    monkeypatch.setattr(train, "train_step", signalled)
    dump = tmp_path / "run"
    argv = merge(TINY, ["--job.dump_folder", str(dump), "--checkpoint.enable", "--training.steps", "8",
                        "--checkpoint.save_on_signal", "SIGTERM,SIGUSR1"])
    assert train.main(argv) == REQUEUE_EXIT
    assert f"tessera: stopped on SIGUSR1 after step 3 of 8: checkpoint step 3 saved in {dump}/checkpoint" \
        in capsys.readouterr().err
    assert resume_point(str(dump / "checkpoint"))[0] == 3 and read_metrics(dump)[-1]["step"] == 3
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the loop's handlers are gone with it
    assert train.main(merge(argv, ["--checkpoint.save_on_signal", "SIGKILL"])) == 2
    assert "checkpoint.save_on_signal: unknown signal(s) ['SIGKILL']; choose from SIGTERM, SIGUSR1, SIGUSR2" \
        in capsys.readouterr().err


def test_a_stop_saves_at_once_and_a_save_longer_than_the_grace_says_so(tmp_path, capsys, monkeypatch):
    """checkpoint.signal_grace_seconds (1 here, writes slowed to 1.2 s): SIGTERM inside step 3 saves step 3 at once,
    skipping that step's validation and the purge of older checkpoints (keep_latest_k 1 keeps step 2 for the next
    run to drop); the first save longer than the grace says so in one line, and the stop too."""
    from tessera import train
    from tessera.checkpoint.writer import HashingWriter

    step_fn, write_data = train.train_step, HashingWriter.write_data

    def signalled(tr):
        if tr.progress.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_fn(tr)

    def slow(self, plan, planner):
        time.sleep(1.2)
        return write_data(self, plan, planner)
    monkeypatch.setattr(train, "train_step", signalled)
    monkeypatch.setattr(HashingWriter, "write_data", slow)
    dump = tmp_path / "run"
    argv = merge(TINY, ["--job.dump_folder", str(dump), "--checkpoint.enable", "--checkpoint.interval", "2",
                        "--checkpoint.keep_latest_k", "1", "--training.steps", "8", "--validation.enable",
                        "--validation.freq", "1", "--validation.steps", "1", "--checkpoint.signal_grace_seconds", "1"])
    assert train.main(argv) == REQUEUE_EXIT
    with open(dump / "metrics.jsonl") as fh:
        validated = [r["step"] for r in map(json.loads, fh) if "validation/loss" in r]
    assert validated == [1, 2] and read_metrics(dump)[-1]["step"] == 3
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-2", "step-3"]
    out = capsys.readouterr().out.splitlines()
    said = [line.split("] ", 1)[1] for line in out if "signal_grace_seconds = 1" in line]
    assert len(said) == 2 and said[0].startswith("checkpoint step 2 took ") and said[1].startswith(
        "the stop took "), said


# ---- a full disk ---------------------------------------------------------------------------------------------
@pytest.fixture
def full_disk_at(monkeypatch):
    """Writes into a checkpoint folder `step-N` fail as on a full disk (from the test: nothing in the product)."""
    from tessera.checkpoint import folder

    def at(step: int):
        write = folder.HashingFile.write

        def full(self, data):
            if f"step-{step}" in str(getattr(self.raw, "name", "")):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(self, data)
        monkeypatch.setattr(folder.HashingFile, "write", full)
    return at


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_stops_the_run_in_one_line_keeping_the_previous_checkpoint(tmp_path, capsys, full_disk_at, mode):
    """The save of step 4 hits a full disk: one line (folder, room, need), step 2 kept, the partial folder gone;
    an async save's failure ends the run at the next step boundary, before the next save."""
    from tessera.train import main

    full_disk_at(4)
    dump = tmp_path / "run"
    code = main(merge(TINY, ["--job.dump_folder", str(dump), "--training.steps", "8", "--checkpoint.enable",
                             "--checkpoint.interval", "2", "--checkpoint.async_mode", mode]))
    err = capsys.readouterr().err
    assert code == 1
    line = next(ln for ln in err.splitlines() if ln.startswith("tessera: "))
    assert line.startswith(f"tessera: checkpoint step 4 could not be saved to {dump}/checkpoint/step-4 (no space "
                           f"left on device; ") and " free there, a checkpoint of this run needs about " in line
    assert line.endswith("the newest complete checkpoint, step 2, is kept. Training stops: free some space (or lower "
                         "checkpoint.keep_latest_k, or set checkpoint.folder on another disk) and relaunch to resume "
                         "from step 2"), line
    assert "Traceback" not in err
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    assert resume_point(str(dump / "checkpoint"))[0] == 2
    # An async save's failure is found at a step boundary after its thread fails: on a loaded machine as late as
    # step 6's, still before step 6's save (no step-6 folder above).
    assert read_metrics(dump)[-1]["step"] == 4 if mode == "disabled" else read_metrics(dump)[-1]["step"] in (4, 5, 6)


@pytest.mark.fast
def test_no_room_for_a_checkpoint_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    from tessera import config_cli
    from tessera.checkpoint import space
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tessera.train import main

    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**20))  # 1 MiB left
    dump = tmp_path / "run"
    argv = merge(TINY, ["--job.dump_folder", str(dump), "--checkpoint.enable"])
    refusal = (f"tessera: checkpoint.folder: '{dump}/checkpoint' has 1.0 MiB free, but one checkpoint of this run "
               f"needs about 1.5 MiB; free some space or pick another job.dump_folder or checkpoint.folder\n")
    assert config_cli.main(argv) == 2 and capsys.readouterr().err == refusal  # the launch check (run_train.sh)
    assert main(argv) == 2 and capsys.readouterr().err == refusal  # a rank, before anything is built
    assert not dump.exists()
    validate(parse_args(argv), 1)  # a plan or an estimate of the run saves nothing: no refusal


@pytest.mark.fast
def test_the_launcher_reports_ranks_killed_by_a_signal_with_the_shells_status(tmp_path, monkeypatch, capsys):
    """A rank SIGTERMed before its handler exists (during start-up) exits as 143, which requeues; the stop's
    own status wins over a rank torchrun ended after it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from tessera import launch

    def failing(*codes):
        def run(args):
            raise ChildFailedError("tessera.train", {rank: ProcessFailure(rank, 100 + rank, code, str(tmp_path / "x"))
                                                     for rank, code in enumerate(codes)})
        return run
    argv = ["--standalone", "--nproc_per_node=2", "-m", "tessera.train"]
    monkeypatch.setenv("TESSERA_LAUNCHER", "1")  # main sets it: gone again after the test
    handlers = {sig: signal.getsignal(sig) for sig in launch.PASSED_ON}
    try:
        monkeypatch.setattr(launch, "run", failing(-signal.SIGTERM, -signal.SIGTERM))
        assert launch.main(argv) == REQUEUE_EXIT
        assert "tessera: rank 0 was killed by SIGTERM" in capsys.readouterr().err
        monkeypatch.setattr(launch, "run", failing(-signal.SIGTERM, REQUEUE_EXIT))
        assert launch.main(argv) == REQUEUE_EXIT
        monkeypatch.setattr(launch, "run", failing(-signal.SIGKILL))
        assert launch.main(argv) == 128 + signal.SIGKILL
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
