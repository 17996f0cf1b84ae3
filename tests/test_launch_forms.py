"""What users type first (issue 27): a smoke run shorter than its config's schedule runs, saying how in one
warning line; `./run_train.sh --job.config_file X` reads X (run_train.sh adds its CONFIG_FILE only without it)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tessera.optim import lr_lambda, schedule_note
from tessera.preflight import validate
from tessera.schema import parse_args
from tests.launch import ROOT

CONFIGS = ROOT / "configs"
ENV = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "LOG_RANK", "NGPU")}


def _schedule(*argv: str):
    return parse_args(["--job.config_file", str(CONFIGS / "llama3_debug.toml"), *argv]).lr_scheduler


def test_a_run_shorter_than_its_warm_up_takes_the_first_steps_of_the_full_schedule():
    """Warm-up 5, decay to 0.1 over the rest: 3 steps are the full run's first 3, and say where they end."""
    s = _schedule()
    full = [lr_lambda(k, s, 60) for k in range(5)]
    assert [lr_lambda(k, s, 3) for k in range(3)] == full[:3] == [1 / 6, 2 / 6, 3 / 6]
    assert [lr_lambda(k, s, 5) for k in range(5)] == full  # a run as long as its warm-up: no note, no decay
    assert schedule_note(s, 5, 3e-3) is None and schedule_note(s, 60, 3e-3) is None
    assert schedule_note(s, 3, 3e-3) == (
        "lr_scheduler.warmup_steps: 5 is longer than the run (training.steps = 3); the run ends inside the warm-up, "
        "at lr 0.0015 (3/6 of optimizer.lr 0.003), and does not decay: the first 3 steps of the longer run's schedule")


def test_a_decay_longer_than_what_the_warm_up_leaves_is_shortened_to_it():
    s = _schedule("--lr_scheduler.decay_ratio", "0.5")
    assert schedule_note(s, 8, 3e-3) == ("lr_scheduler.decay_ratio: warm-up 5 + decay 4 steps is longer than the "
                                         "run (8 steps); the lr decays over the last 3 steps instead")
    lrs = [lr_lambda(k, s, 8) for k in range(8)]
    assert lrs[:5] == [k / 6 for k in range(1, 6)] and lrs[5] > lrs[6] > lrs[7] == pytest.approx(0.1)
    assert schedule_note(s, 5, 3e-3).endswith("(5 steps); the lr does not decay")
    assert schedule_note(s, 100, 3e-3) is None  # 5 + 50 fit


@pytest.mark.parametrize("config, steps", [("llama3_debug.toml", 3), ("flux_debug.toml", 8)])
def test_shortened_debug_configs_pass_the_pre_check(config, steps, tmp_path):
    validate(parse_args(["--job.config_file", str(CONFIGS / config), "--training.steps", str(steps),
                         "--job.dump_folder", str(tmp_path)]), 2)


@pytest.mark.ranks
def test_the_smoke_run_runs_with_one_warning_line(tmp_path):
    """`./run_train.sh --training.steps 3`, the first thing a user types, on the default config."""
    proc = subprocess.run(["bash", str(ROOT / "run_train.sh"), "--training.steps", "3"],
                          env={**ENV, "NGPU": "1", "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if "lr_scheduler" in line]
    assert len(notes) == 1 and notes[0].endswith(schedule_note(_schedule(), 3, 3e-3)), proc.stdout
    with open(tmp_path / "outputs/llama3_debug/metrics.jsonl") as fh:
        last = [json.loads(line) for line in fh if '"validation/' not in line][-1]
    assert last["step"] == 3 and last["lr"] == pytest.approx(3e-3 * 3 / 6)


# ---------------------------------------------------------------------------------------------------------------
# ./run_train.sh --job.config_file X


def _run_train_sh(cwd: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "run_train.sh"), *argv], env={**ENV, "NGPU": "1", **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _user_lines(stderr: str) -> list[str]:
    """run_train.sh's and the pre-check's lines (not a first venv set-up's)."""
    return [x for x in stderr.splitlines() if x.startswith("tessera:")
            and not x.startswith(("tessera: setting up", "tessera: reusing"))]


@pytest.mark.ranks
def test_run_train_sh_reads_the_users_config_file_and_refuses_one_given_twice(tmp_path):
    bad = tmp_path / "mine.toml"
    bad.write_text("[training]\nsteps = 0\n")  # refused by the pre-check: proof of which file was read
    read = f"tessera: training.steps (in {bad}): 0 is below the minimum 1"
    for flag in ([f"--job.config_file={bad}"], ["--job.config_file", str(bad)]):
        proc = _run_train_sh(tmp_path, *flag)
        assert proc.returncode == 2 and _user_lines(proc.stderr) == [read], proc.stderr
    proc = _run_train_sh(tmp_path, "--job.config_file", str(bad), CONFIG_FILE=str(CONFIGS / "qwen3_debug.toml"))
    assert proc.returncode == 2 and _user_lines(proc.stderr) == [
        f"tessera: --job.config_file {bad} is read, not CONFIG_FILE={CONFIGS / 'qwen3_debug.toml'}", read]
    proc = _run_train_sh(tmp_path, "--job.config_file", str(bad), f"--job.config_file={bad}")
    assert proc.returncode == 2 and _user_lines(proc.stderr) == [
        "tessera: --job.config_file is given twice on the command line; keep one"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.ranks
def test_run_train_sh_passes_one_config_file_to_the_check_and_the_ranks(tmp_path):
    """With a python that records its arguments: the pre-check and the launch both get the user's file, once."""
    venv, log = tmp_path / "venv", tmp_path / "args.log"
    (venv / "bin").mkdir(parents=True)
    stamp = subprocess.run("cat requirements-dev.txt constraints.txt | cksum", shell=True, cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    (venv / ".tessera-deps").write_text(stamp)  # env.sh's stamp: no venv set-up
    (venv / "bin" / "python").write_text(f'#!/bin/bash\necho "$*" >> {log}\n')
    (venv / "bin" / "python").chmod(0o755)
    for argv, wanted in ((["--training.steps", "3"], f"--job.config_file {CONFIGS / 'llama3_debug.toml'}"),
                         (["--job.config_file=x.toml", "--training.steps", "3"], "--job.config_file=x.toml")):
        log.unlink(missing_ok=True)
        proc = _run_train_sh(tmp_path, *argv, TESSERA_VENV=str(venv))
        assert proc.returncode == 0, proc.stderr
        check, launch = log.read_text().splitlines()
        assert check == f"-m tessera.config --world-size 1 --errors-only {wanted} --training.steps 3"
        assert launch.endswith(f"-m tessera.train {wanted} --training.steps 3") and launch.count("config_file") == 1
