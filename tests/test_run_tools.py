"""Around a run (issue 17): profiler traces and memory timelines on their schedule, the run report, loss compare,
the non-finite policy (skip: no update, counted; stop), and a stuck rank ending the run at its comm timeout."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tessera import loss_compare, report, train
from tests.faults import faulty
from tests.launch import ROOT, TINY, merge, read_metrics, run_local


def test_profiler_writes_a_trace_and_a_memory_timeline_every_profile_freq_steps(tmp_path):
    run_local(tmp_path, "--training.steps", "7", "--profiling.enable_profiling", "--profiling.profile_freq", "3",
              "--profiling.enable_memory_snapshot")
    traces = sorted(os.listdir(tmp_path / "profile_traces"))
    assert traces == ["iteration_3", "iteration_6"]
    with open(tmp_path / "profile_traces" / "iteration_6" / "rank0_trace.json") as fh:
        names = {e.get("name", "") for e in json.load(fh)["traceEvents"]}
    assert {"aten::mm", "aten::addmm"} & names and "Optimizer.step#AdamW.step" in names
    timeline = tmp_path / "memory_snapshot" / "iteration_3" / "rank0_memory.html"
    assert timeline.stat().st_size > 1000 and b"<img" in timeline.read_bytes()


def _main(dump, *args) -> int:
    return train.main(merge(TINY, ["--job.dump_folder", str(dump)], args))


def test_nonfinite_skip_applies_no_update_and_counts_and_stop_names_the_step(tmp_path, monkeypatch, capsys):
    seen, original = {}, train.train_step

    def recording(tr):  # the weights and Adam's step counts around step 3, whose gradients are NaN
        if tr.progress.step + 1 == 3:
            seen["before"] = {n: p.detach().clone() for n, p in tr.step_parts.model.named_parameters()}
        out = poisoned(tr)
        if tr.progress.step + 1 == 3:
            seen["after"] = {n: p.detach().clone() for n, p in tr.step_parts.model.named_parameters()}
            seen["adam_steps"] = {float(s["step"]) for s in tr.optimizer.state.values()}
        return out
    poisoned = faulty(original, nan_steps=frozenset({3}))
    monkeypatch.setattr(train, "train_step", recording)
    assert _main(tmp_path / "skip", "--training.nonfinite_policy", "skip") == 0
    for name, before in seen["before"].items():
        assert torch.equal(before, seen["after"][name]), name
    assert seen["adam_steps"] == {2.0}  # steps 1 and 2 applied, 3 not
    metrics = read_metrics(tmp_path / "skip")
    assert [m["skipped_steps"] for m in metrics] == [0, 0, 1, 1, 1]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics[3:])
    capsys.readouterr()
    # The default, stop: the run ends naming the step.
    monkeypatch.setattr(train, "train_step", poisoned)
    assert _main(tmp_path / "stop") == 1
    assert "tessera: step 3: non-finite loss or grad norm" in capsys.readouterr().err
    # A limit: more skipped steps than it stop the run.
    monkeypatch.setattr(train, "train_step", faulty(original, nan_steps=frozenset({2, 4})))
    assert _main(tmp_path / "limit", "--training.nonfinite_policy", "skip", "--training.max_skipped_steps", "1") == 1
    assert "step 4: non-finite grad norm, 2 skipped steps, more than training.max_skipped_steps = 1" \
        in capsys.readouterr().err


@pytest.mark.ranks
def test_a_stuck_rank_ends_the_run_at_the_train_timeout_naming_the_step(tmp_path):
    """Rank 1 stalls before step 3 for longer than comm.train_timeout_seconds: rank 0's collective gives up and
    the job ends with one line naming the step and the option, instead of hanging (the first step ran under
    the longer init timeout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TESSERA_TEST_STALL": "1:3:60"}
    cmd = [sys.executable, "-m", "tessera.launch", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "faults.py"),
           *merge(TINY, ["--job.dump_folder", str(tmp_path), "--comm.train_timeout_seconds", "3"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "tessera: step 3: a collective waited longer than comm.train_timeout_seconds = 3 s" in proc.stderr
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]


def _png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_report_overlays_runs_and_loss_compare_passes_equal_runs_and_fails_different_ones(tmp_path, capsys):
    a = run_local(tmp_path / "a", "--validation.enable", "--validation.freq", "2", "--validation.steps", "1")
    b = run_local(tmp_path / "b", "--optimizer.lr", "1e-2")
    assert _png_size(tmp_path / "a" / "report.png")[0] > 500  # the trainer's own, at the end of the run
    assert report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "both")]) == 0
    assert _png_size(tmp_path / "both" / "report.png") == (1500, 800)
    table = (tmp_path / "both" / "report.md").read_text()
    assert f"| a | 5 | {a[-1]['loss']:.4f} |" in table and f"| b | 5 | {b[-1]['loss']:.4f} |" in table
    assert report.main([str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err

    shutil.copytree(tmp_path / "a", tmp_path / "a2")
    assert loss_compare.main([str(tmp_path / "a"), str(tmp_path / "a2"), "--out", str(tmp_path / "same")]) == 0
    assert "PASS: max |A-B|/|A| 0.00e+00" in capsys.readouterr().out
    assert loss_compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "diff")]) == 1
    result = json.loads((tmp_path / "diff" / "compare.json").read_text())
    # The lr differs, so step 1 (before any update) agrees and step 2 no longer does.
    assert not result["passed"] and result["rel_diff"][0] == 0 and result["steps_over"][0] == 2
    assert (tmp_path / "diff" / "compare.png").stat().st_size > 10_000


LAYOUT_FLAGS = ["--model.flavor=tiny", "--training.seq_len=32", "--training.local_batch_size=2",
                "--training.deterministic", "--lr_scheduler.warmup_steps=1", "--validation.enable=false",
                "--metrics.enable_tensorboard=false"]


@pytest.mark.filterwarnings("ignore")
def test_loss_compare_runs_two_layouts_of_one_config(tmp_path, capsys):
    """One process against FSDP over 2, from a shipped config whose global batch follows the layout: both train
    B's (A accumulating 2 micro-batches), equal within 1e-5."""
    config = str(ROOT / "configs" / "llama3_debug.toml")
    code = loss_compare.main([config, config, "--steps", "4", f"--overrides={' '.join(LAYOUT_FLAGS)}", "--nproc_b",
                              "2", "--tolerance", "1e-5", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "loss_compare: A would train a global batch of 2 sequences a step and B one of 4; both train 4 " \
           "(--training.global_batch_size 4; a layout below it accumulates) to compare like with like" in out
    assert "PASS" in out and len(read_metrics(tmp_path / "a")) == len(read_metrics(tmp_path / "b")) == 4


def test_loss_compare_refuses_two_different_global_batches_before_running(tmp_path, capsys):
    config = str(ROOT / "configs" / "llama3_debug.toml")
    code = loss_compare.main([config, config, f"--overrides={' '.join(LAYOUT_FLAGS)}",
                              "--a=--training.global_batch_size=2", "--b=--training.global_batch_size=4", "--nproc_b",
                              "2", "--out", str(tmp_path)])
    assert code == 2 and capsys.readouterr().err.splitlines() == [
        "tessera.loss_compare: A trains a global batch of 2 sequences a step and B one of 4, so a step of one is not "
        "a step of the other; give both one --training.global_batch_size (in --overrides), a multiple of 2 (A's "
        "local batch x data-parallel degree) and of 4 (B's)"]
    code = loss_compare.main([config, config, f"--overrides={' '.join(LAYOUT_FLAGS)}",
                              "--a=--training.global_batch_size=6", "--nproc_b", "2", "--out", str(tmp_path)])
    assert code == 2 and "A trains a global batch of 6 sequences a step and B one of 4" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "a")  # nothing ran
