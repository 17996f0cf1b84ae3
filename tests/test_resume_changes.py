"""What changed between a run and its resume: settings applied (optimizer), files and checkpoints checked before
any rank starts (damaged checkpoints, changed data or tokenizer, damaged exports)."""

import json
import logging
import tempfile

import pytest
import torch

from tessera.optim import lr_lambda
from tessera.train import train
from tests.dist_worker import BASE, _trainer, full_params, run_train
from tests.launch import merge, resume_copy

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.last_save_model_only=false"]


@pytest.fixture
def warnings_logged():
    """The warnings the "tessera" logger gives while the test runs."""
    found: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: found.append(record.getMessage())
    logger = logging.getLogger("tessera")
    logger.addHandler(handler)
    yield found
    logger.removeHandler(handler)


def test_optimizer_settings_changed_on_resume_are_applied(tmp_path, warnings_logged):
    """lr, betas, eps, weight decay and Adam instead of AdamW, given on resume: the saved moments go on under
    the new settings and the schedule continues at the step reached with the new peak, said in one line."""
    run_train(["--job.dump_folder", str(tmp_path / "run"), *CKPT], 4)
    changed = ["--optimizer.lr", "1e-3", "--optimizer.beta1", "0.8", "--optimizer.beta2", "0.9", "--optimizer.eps",
               "1e-6", "--optimizer.weight_decay", "0.3", "--optimizer.name", "Adam"]
    same = run_train(["--job.dump_folder", str(resume_copy(tmp_path / "run", tmp_path / "same", 4)), *CKPT], 6)
    assert not [w for w in warnings_logged if "attn_mask_type" in w]  # auto resolves to what it trained with
    warnings_logged.clear()
    new = run_train(["--job.dump_folder", str(resume_copy(tmp_path / "run", tmp_path / "new", 4)), *CKPT,
                     *changed], 6)
    assert new["start"] == same["start"] == 4
    said = [w for w in warnings_logged if w.startswith("optimizer: ")]
    from tessera.preflight import validate
    from tessera.schema import parse_args

    masked = merge(BASE, ["--job.dump_folder", str(tmp_path / "new"), *CKPT, "--training.steps", "8",
                          "--model.attn_mask_type", "block_causal"])
    assert validate(parse_args(masked), 1).cfg.model.attn_mask_type == "block_causal"  # applied, and said:
    assert warnings_logged[-1] == (f"model.attn_mask_type: the checkpoint at {tmp_path}/new/checkpoint/step-6 "
                                   f"trained with causal, this run goes on with block_causal")
    assert len(said) == 1 and said[0].startswith("optimizer: name AdamW -> Adam, lr 0.003 -> 0.001, beta1 0.9 -> "
                                                 "0.8, beta2 0.95 -> 0.9, eps 1e-08 -> 1e-06, weight_decay 0.1 -> "
                                                 "0.3 since the checkpoint at "), said
    cfg = _trainer(["--job.dump_folder", str(tmp_path / "cfg")], 6, str(tmp_path / "cfg")).cfg.lr_scheduler
    assert new["lrs"] == {s: pytest.approx(1e-3 * lr_lambda(s - 1, cfg, 6), rel=1e-12) for s in (5, 6)}
    assert new["losses"][5] == same["losses"][5] and new["losses"][6] != same["losses"][6]
    # The reference: the unchanged resume, its optimizer's settings and peak lr then set by hand.
    with tempfile.TemporaryDirectory() as scratch:
        tr = _trainer(["--job.dump_folder", str(resume_copy(tmp_path / "run", tmp_path / "ref", 4)), *CKPT], 6,
                      scratch)
        for group in tr.optimizer.param_groups:
            group.update(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3, decoupled_weight_decay=False)
        tr.scheduler.base_lrs = [1e-3] * len(tr.optimizer.param_groups)
        for group in tr.optimizer.param_groups:
            group["lr"] = 1e-3 * lr_lambda(tr.progress.step, cfg, 6)
        train(tr)
        tr.metrics.close()
        for name, value in full_params(tr.step_parts.model).items():
            torch.testing.assert_close(new["params"][name], value, rtol=0, atol=0)


def _flip_middle(file, count: int = 64) -> None:
    """Damage a file in place, its size unchanged: only its checksum tells."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    file.write_bytes(bytes(data))


def test_every_checkpoint_damaged_is_refused_and_never_overwritten(tmp_path, capsys):
    """Steps 2 and 4 both damaged (or keep_latest_k = 1 and its only one): one line before any rank starts, exit 2,
    nothing written; the ranks' own look-up (sizes checked before them) refuses the same; with
    checkpoint.start_fresh_if_all_damaged the run trains from step 0 and the damaged ones are kept aside."""
    from tessera.checkpoint.folder import digest_file
    from tessera.checkpoint.resume import find_resume
    from tessera.config import ConfigError
    from tessera.schema import parse_args
    from tessera.train import main
    from tests.dist_worker import BASE

    dump, root = tmp_path / "run", tmp_path / "run/checkpoint"
    argv = merge(BASE, ["--job.dump_folder", str(dump)], CKPT, ["--checkpoint.interval", "2", "--training.steps", "4"])
    assert main(argv) == 0
    for step in (2, 4):
        _flip_middle(root / f"step-{step}/__0_0.distcp")
    before = {p: digest_file(str(p)) for p in root.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"tessera: job.dump_folder: every checkpoint under {root} is damaged (step 4: {root}/step-4/__0_0.distcp "
        f"changed after it was written"), err
    assert f"; step 2: {root}/step-2/__0_0.distcp changed" in err[0] and err[0].endswith(
        f"so the run would start over from step 0; repair them, move them out of {root}, or set "
        f"--checkpoint.start_fresh_if_all_damaged to train from step 0 (they are then moved to {root}/damaged "
        f"and kept)"), err
    assert {p: digest_file(str(p)) for p in root.rglob("*") if p.is_file()} == before
    with pytest.raises(ConfigError, match=f"every checkpoint under {root} is damaged"):
        find_resume(parse_args(argv))  # a rank's look-up: it finds the checksums wrong itself
    capsys.readouterr()
    assert main([*argv, "--checkpoint.start_fresh_if_all_damaged"]) == 0
    assert sorted(p.name for p in (root / "damaged").iterdir()) == ["step-2", "step-4"]
    assert {p: digest_file(str(p)) for p in (root / "damaged").rglob("*") if p.is_file()} == {
        root / "damaged" / p.relative_to(root): d for p, d in before.items()}
    assert main(argv) == 0  # the new checkpoints are intact: it resumes from step 4, nothing to train
    # keep_latest_k = 1, its only checkpoint damaged
    one = tmp_path / "one"
    argv = merge(BASE, ["--job.dump_folder", str(one)], CKPT, ["--checkpoint.keep_latest_k", "1",
                                                               "--training.steps", "4"])
    assert main(argv) == 0 and sorted(p.name for p in (one / "checkpoint").iterdir()) == ["step-4"]
    _flip_middle(one / "checkpoint/step-4/__0_0.distcp")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every checkpoint under" in err[0] and "(step 4: " in err[0], err


def test_damaged_load_step_and_another_tokenizer_are_refused_at_launch(tmp_path, capsys):
    """The launch check (`python -m tessera.config`, before any rank starts) compares checksums, not only sizes,
    of the checkpoint checkpoint.load_step names; and the tokenizer's vocabulary with the checkpoint's."""
    from tessera import config_cli
    from tessera.train import main
    from tests.dist_worker import BASE
    from tests.test_prepared import word_tokenizer

    dump, root = tmp_path / "run", tmp_path / "run/checkpoint"
    argv = merge(BASE, ["--job.dump_folder", str(dump), "--model.hf_assets_path",
                        str(word_tokenizer(tmp_path / "tok", 20))], CKPT,
                 ["--checkpoint.interval", "2", "--training.steps", "4"])
    assert main(argv) == 0
    assert config_cli.main([*argv, "--checkpoint.load_step", "2"]) == 0
    for name in (".metadata", "__0_0.distcp"):
        damaged = root / f"step-2/{name}"
        intact = damaged.read_bytes()
        _flip_middle(damaged, 8)
        capsys.readouterr()
        assert config_cli.main([*argv, "--checkpoint.load_step", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"tessera: checkpoint.load_step: step 2 at {root}/step-2 is not "
                                                   f"usable: {damaged} changed after it was written"), err
        damaged.write_bytes(intact)
    other = word_tokenizer(tmp_path / "other", 30)
    capsys.readouterr()
    assert config_cli.main(merge(argv, ["--model.hf_assets_path", str(other)])) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"tessera: model.hf_assets_path: the tokenizer {other}/tokenizer.json has 40 tokens, but the model of the "
        f"checkpoint at {root}/step-4 has a vocabulary of 30: it was trained with another tokenizer; resume with "
        f"that one, or pick another job.dump_folder"]


def test_hf_folders_are_checked_before_ranks_start(tmp_path, capsys):
    """checkpoint.initial_load_path with initial_load_in_hf: an export with a .complete marker is checked against
    its checksums, and any folder's safetensors by their headers, before ranks start; a folder without a marker
    (from a hub) is accepted."""
    import shutil

    from tessera import config_cli
    from tessera.train import main
    from tests.dist_worker import BASE

    assert main(merge(BASE, ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable",
                             "--checkpoint.last_save_in_hf", "--training.steps", "1"])) == 0
    export = tmp_path / "run/checkpoint/exports/step-1"
    hub = tmp_path / "hub"  # the same files as a hub download: no marker
    shutil.copytree(export, hub, ignore=shutil.ignore_patterns(".complete"))
    argv = merge(BASE, ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--model.flavor=",
                        "--training.steps", "1"])

    def check(folder) -> list[str]:
        capsys.readouterr()
        code = config_cli.main([*argv, "--job.dump_folder", str(tmp_path / "new"), "--checkpoint.initial_load_path",
                               str(folder)])
        err = capsys.readouterr().err.strip().splitlines()
        assert (code == 0) == (not err), (code, err)
        return err

    assert check(export) == [] and check(hub) == []
    weights = next(export.glob("*.safetensors"))
    _flip_middle(weights)
    err = check(export)
    assert len(err) == 1 and err[0].startswith(f"tessera: checkpoint.initial_load_path: '{export}' is damaged: "
                                               f"{weights} changed after it was written"), err
    assert check(hub) == []  # the intact copy, unmarked
    hub_weights = hub / weights.name
    whole = hub_weights.read_bytes()
    hub_weights.write_bytes(whole[: len(whole) - 100])
    assert check(hub) == [f"tessera: checkpoint.initial_load_path: {hub_weights} has {len(whole) - 100} bytes, but "
                          f"its header describes {len(whole)}: it was cut short or altered; download or export it "
                          f"again"]
    hub_weights.write_bytes(b"<html>not found</html>" * 10)
    err = check(hub)
    assert len(err) == 1 and err[0].startswith(f"tessera: checkpoint.initial_load_path: {hub_weights} is truncated "
                                               f"or not a safetensors file"), err


def test_changed_data_or_tokenizer_under_the_same_path_is_refused(tmp_path, capsys):
    """Each checkpoint records fingerprints of the data files (size, sampled blocks) and of tokenizer.json (whole):
    a file rewritten in place, grown, or a tokenizer with other ids is refused before ranks start, with the ways
    out; checkpoints from before the fingerprints still resume."""
    from tessera import config_cli
    from tessera.checkpoint.folder import write_marker
    from tessera.train import main
    from tests.dist_worker import BASE
    from tests.test_prepared import word_tokenizer

    data, tok = tmp_path / "data.jsonl", word_tokenizer(tmp_path / "tok", 20)
    lines = [json.dumps({"text": " ".join(["doc row the text file ab cd"] * (1 + i % 7))}) for i in range(400)]
    data.write_text("\n".join(lines) + "\n")
    dump = tmp_path / "run"
    argv = merge(BASE, ["--job.dump_folder", str(dump), "--model.hf_assets_path", str(tok), "--training.dataset",
                        "files", "--training.dataset_path", str(data)], CKPT,
                 ["--checkpoint.interval", "2", "--training.steps", "2"])
    assert main(argv) == 0
    step = dump / "checkpoint/step-2"
    record = json.loads((step / "inputs.json").read_text())
    assert [f["file"] for f in record["data"]] == [str(data)] and record["tokenizer"]["file"] == f"{tok}/tokenizer.json"
    argv = merge(argv, ["--training.steps", "4"])

    def check(*extra: str) -> list[str]:
        capsys.readouterr()
        code = config_cli.main(merge(argv, list(extra)))
        err = capsys.readouterr().err.strip().splitlines()
        assert (code == 0) == (not err) and code in (0, 2), (code, err)
        return err

    assert check() == []
    ways = (f"since the checkpoint at {step}, whose data position counts samples of what it read; resume with "
            f"those files, add dataloader to checkpoint.exclude_from_loading to start this data at its first sample, "
            f"or set --checkpoint.accept_changed_data to resume the position in the changed files on purpose (e.g. "
            f"documents appended)")
    original = data.read_bytes()
    data.write_text("\n".join(reversed(lines)) + "\n")  # rewritten in place: the same size, other order
    err = check()
    assert len(err) == 1 and err[0].startswith(f"tessera: training.dataset_path: {data} has changed (the same size, "
                                               f"other content (its sampled xxh3_64 was ") and err[0].endswith(ways)
    assert check("--checkpoint.accept_changed_data") == []
    assert check("--checkpoint.exclude_from_loading", "dataloader") == []
    data.write_bytes(original + b'{"text": "doc doc"}\n')  # appended
    assert check() == [f"tessera: training.dataset_path: {data} has changed ({len(original)} bytes then, "
                       f"{len(original) + 20} now) {ways}"]
    data.write_bytes(original)
    tokenizer = tok / "tokenizer.json"
    saved_tokenizer = tokenizer.read_text()
    table = json.loads(saved_tokenizer)
    vocab = table["model"]["vocab"]
    vocab["doc"], vocab["row"] = vocab["row"], vocab["doc"]  # the same words and count, other ids
    tokenizer.write_text(json.dumps(table))
    ids = (f"since the checkpoint at {step}, whose model learned that tokenizer's ids; resume with that tokenizer, "
           f"or set --checkpoint.accept_changed_data to go on with this one on purpose")
    for extra in ([], ["--checkpoint.exclude_from_loading", "dataloader"]):  # the weights learned the old ids
        err = check(*extra)
        assert len(err) == 1 and err[0].startswith(f"tessera: model.hf_assets_path: {tokenizer} has changed (") \
            and err[0].endswith(ids), err
    assert check("--checkpoint.accept_changed_data") == []
    # A checkpoint from before fingerprints: resumes as before
    (step / "inputs.json").unlink()
    (step / ".complete").unlink()
    write_marker(str(step), 2, "full")
    assert check() == [] and main(argv) == 0
