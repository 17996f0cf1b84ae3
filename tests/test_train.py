"""The single-process trainer end to end: learning, outputs, and stopping on a diverged run."""

import json
import tomllib

from tests.launch import run_local


def test_loss_falls_clearly_within_50_steps(tmp_path):
    rows = run_local(tmp_path, "--training.steps", "50", "--training.seq_len", "64", "--metrics.log_freq", "10",
                     "--lr_scheduler.warmup_steps", "5")
    # Byte-level loss starts near ln(258) = 5.55; learning the byte statistics of Python source takes it well below.
    assert rows[0]["loss"] > 4.5 and rows[-1]["loss"] < rows[0]["loss"] - 1.5


def test_outputs_config_metrics_and_validation(tmp_path):
    rows = run_local(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2", "--validation.enable",
                     "--validation.freq", "2", "--validation.steps", "1", "--metrics.enable_tensorboard")
    assert [r["step"] for r in rows] == [2, 4]
    assert {"loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "data_share"} <= rows[0].keys()
    assert all(r["tps"] > 0 and 0 < r["mfu"] < 2 and r["memory_gib"] > 0 for r in rows)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "validation/loss" in x] == [2, 4]
    saved = tomllib.loads((tmp_path / "config.toml").read_text())
    assert saved["training"]["steps"] == 4 and saved["model"]["flavor"] == "tiny"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


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
    _, norm, _ = train_step(tr)
    after = torch.nn.utils.get_total_norm([p.grad for p in tr.model.parameters()])
    assert norm > 0.2 and abs(after.item() - 0.1) < 1e-6  # returns the norm before clipping
