"""The single-process trainer end to end: learning, outputs, and stopping on a diverged run."""

import json
import tomllib

import pytest

from tests.launch import run_local


def test_loss_falls_clearly_within_50_steps(tmp_path):
    rows = run_local(tmp_path, "--training.steps", "50", "--training.seq_len", "64", "--metrics.log_freq", "10",
                     "--lr_scheduler.warmup_steps", "5", "--metrics.peak_flops", "1e12")
    # Byte-level loss starts near ln(258) = 5.55; learning the byte statistics of Python source takes it well below.
    assert rows[0]["loss"] > 4.5 and rows[-1]["loss"] < rows[0]["loss"] - 1.5
    assert all(r["mfu"] == pytest.approx(r["tflops"]) for r in rows)  # over the given peak, 1e12 FLOP/s


def test_outputs_config_metrics_and_validation(tmp_path):
    rows = run_local(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2", "--validation.enable",
                     "--validation.freq", "2", "--validation.steps", "1", "--metrics.enable_tensorboard")
    assert [r["step"] for r in rows] == [2, 4]
    assert {"loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "data_share"} <= rows[0].keys()
    assert all(r["tps"] > 0 and 0 < r["mfu"] <= 1 and r["memory_gib"] > 0 for r in rows)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "validation/loss" in x] == [2, 4]
    saved = tomllib.loads((tmp_path / "config.toml").read_text())
    assert saved["training"]["steps"] == 4 and saved["model"]["flavor"] == "tiny"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.fast
def test_mfu_never_passes_100_percent(caplog):
    """A step faster than the peak (a GEMM measured while the machine was busier, a metrics.peak_flops too low)
    proves the peak low: the ceiling rises to the FLOP/s achieved, said in one line, once."""
    from tessera.metrics import Peak

    peak = Peak(1e9, "measured fp32 GEMM on CPU (2 threads)")
    with caplog.at_level("WARNING", logger="tessera"):
        shares = [peak.mfu(flops) for flops in (5e8, 1.25e9, 1e9, 2e9, 1e9)]
    assert shares == [0.5, 1.0, 0.8, 1.0, 0.5]
    assert [r.getMessage() for r in caplog.records] == [
        "mfu: 1.25e+09 FLOP/s achieved, above the peak of 1e+09 (measured fp32 GEMM on CPU (2 threads)), which is "
        "therefore uncertain: MFU is taken against the highest FLOP/s achieved from here on; set metrics.peak_flops "
        "to the device's peak for a fixed one"]
    quiet = Peak(1e9, "metrics.peak_flops", say=False)  # a rank other than 0
    assert quiet.mfu(3e9) == 1.0 and quiet.flops == 3e9 and len(caplog.records) == 1


def test_non_finite_loss_stops_with_step(tmp_path, capsys):
    from tessera.train import main

    code = main(["--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "5",
                 "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "0",
                 "--job.dump_folder", str(tmp_path)])
    assert code == 1
    assert "tessera: step 2: non-finite loss" in capsys.readouterr().err


def test_clipping_scales_gradients_to_max_norm(tmp_path):
    import torch

    from tessera.train import train_step
    from tests.dist_worker import _trainer

    tr = _trainer(["--training.max_norm", "0.1", "--lr_scheduler.warmup_steps", "1"], 1, str(tmp_path))
    norm = train_step(tr)[1]
    after = torch.nn.utils.get_total_norm([p.grad for p in tr.step_parts.model.parameters()])
    assert norm > 0.2 and abs(after.item() - 0.1) < 1e-6  # returns the norm before clipping


def test_a_familys_loss_and_batch_hooks_replace_the_defaults(monkeypatch):
    """What a family with other data or another objective (Flux) plugs in: its batch and its loss. The batch hook
    gets the run's loader and a typed view of the run (not the Trainer)."""
    import dataclasses
    import tempfile

    import torch

    from tessera.models import family
    from tessera.models.contract import BatchView, Family, OwnTraining
    from tessera.trainer import loss_fn, token_batch
    from tests.dist_worker import _trainer, run_grads, step_and_record

    calls = []

    def batch(run, loader):
        calls.append((run, loader))
        return token_batch(run, loader)

    own = OwnTraining(batch=batch,  # the token loader (data=None); a family's loss is its micro-batch's mean
                      loss=lambda logits, labels: 2 * loss_fn(logits, labels) / labels.numel())
    spec = dataclasses.replace(family("llama3").spec(), training=own)
    argv = ["--training.local_batch_size", "4", "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps",
            "0", "--training.max_norm", "0"]
    plain = run_grads(argv, 1)
    monkeypatch.setattr(Family, "spec", lambda self: spec)
    with tempfile.TemporaryDirectory() as dump:
        tr = _trainer(argv, 1, dump)
        hooked = step_and_record(tr, 1)
    # the trainer drew both micro-batches of its training loader through the hook
    assert [loader is tr.loader for _, loader in calls] == [True, True]
    assert all(type(run) is BatchView and run.world is tr.world for run, _ in calls)
    assert abs(hooked["losses"][0] - 2 * plain["losses"][0]) < 1e-5
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(hooked["grads"][name], 2 * grad, rtol=1e-5, atol=1e-7)
