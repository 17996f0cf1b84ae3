"""No silent failure: runs extend with their whole state, bad launches write nothing and say why in one line,
and values that would break a run are refused before any rank starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.dist_worker import BASE, run_train
from tests.launch import ROOT, merge
from tests.test_checkpoint import global_batch_ids

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _main(*argv: str) -> int:
    from tessera.train import main

    return main(merge(BASE, ["--training.steps", "4"], argv))


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


def _optimizer_steps(checkpoint: Path, tmp: Path) -> set[int]:
    dcp_to_torch_save(str(checkpoint), str(tmp / "ckpt.pt"))
    state = torch.load(tmp / "ckpt.pt", weights_only=False)["optimizer"]["state"]
    return {int(s["step"]) for s in state.values()}


def test_extending_a_finished_run_continues_its_whole_state(tmp_path):
    dump = tmp_path / "run"
    first = run_train(["--job.dump_folder", str(dump), *CKPT], 10)
    ckpt = dump / "checkpoint"
    # The final save is a full checkpoint; the model-only export sits apart and is never a resume point.
    assert sorted(os.listdir(ckpt)) == ["exports", "step-10"]  # keep_latest_k = 1 kept the newest full one
    assert json.loads((ckpt / "step-10/.complete").read_text())["kind"] == "full"
    assert json.loads((ckpt / "exports/step-10/.complete").read_text())["kind"] == "model"
    more = run_train(["--job.dump_folder", str(dump), *CKPT], 15)
    assert more["start"] == 10 and sorted(more["losses"]) == list(range(11, 16))
    lrs = [more["lrs"][s] for s in range(11, 16)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)) and lrs[0] > 0  # warm-up did not restart
    assert first["lrs"][1] < first["lrs"][2]  # (it did run in the first part)
    assert more["tokens_seen"] == first["tokens_seen"] * 15 // 10
    jumps = [abs(first["losses"][s] - first["losses"][s - 1]) for s in range(2, 11)]
    assert abs(more["losses"][11] - first["losses"][10]) <= max(jumps)
    # The data goes on where it stopped: steps 11-15 take the next samples of the global stream, as one run would.
    stream = global_batch_ids(BASE, 8, 15)
    assert [sorted(first["samples"][s]) for s in range(1, 11)] == stream[:10]
    assert [sorted(more["samples"][s]) for s in range(11, 16)] == stream[10:]
    assert _optimizer_steps(ckpt / "step-15", tmp_path) == {15}  # Adam's moments carried on, not restarted


def test_relaunch_with_fewer_steps_than_reached_is_refused(tmp_path, capsys):
    dump = tmp_path / "run"
    run_train(["--job.dump_folder", str(dump), *CKPT], 4)
    before = _snapshot(dump)
    assert _main("--job.dump_folder", str(dump), *CKPT, "--training.steps", "3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tessera: training.steps: 3 is below step 4, which the checkpoint at {dump}/checkpoint/step-4 "
                   f"reached; raise training.steps to extend the run, or pick another job.dump_folder"]
    assert _snapshot(dump) == before


@pytest.mark.parametrize("change, expect", [
    (["--model.flavor", "debugmodel"],
     "holds a model that differs in 5 field(s): dim: 64 (checkpoint) vs 256 (asked); n_layers: 2"),
    (["--training.data_streams", "8"], "training.data_streams: 8, but the checkpoint at"),
    (["--checkpoint.load_step", "3"], "checkpoint.load_step: no checkpoint for step 3 under"),
])
def test_a_launch_that_does_not_match_the_dump_folder_is_refused_and_writes_nothing(tmp_path, capsys, change,
                                                                                     expect):
    dump = tmp_path / "run"
    run_train(["--job.dump_folder", str(dump), *CKPT, "--metrics.enable_tensorboard"], 4)
    before = _snapshot(dump)
    assert _main("--job.dump_folder", str(dump), *CKPT, "--metrics.enable_tensorboard", *change) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
    assert _snapshot(dump) == before  # config.toml and the TensorBoard events untouched
    pre = subprocess.run([sys.executable, "-m", "tessera.config", *merge(BASE, ["--training.steps", "4"], [
                          "--job.dump_folder", str(dump), *CKPT], change)], env=ENV, capture_output=True, text=True)
    assert pre.returncode == 2 and expect in pre.stderr  # the launch pre-check says the same, before any rank


def test_data_settings_changed_on_resume_are_refused_unless_the_data_position_is_left(tmp_path, capsys):
    """The data position a checkpoint restores counts samples of its data: another seed, seq_len or dataset is
    refused before any rank starts, naming both values and the way out, which starts the new data at its first
    sample (a longer context later in training)."""
    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import parse_args

    dump = tmp_path / "run"
    run_train(["--job.dump_folder", str(dump), *CKPT], 4)
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(f"document {k} of the other corpus" for k in range(50)))
    ckpt, before = dump / "checkpoint/step-4", _snapshot(dump)
    way_out = ("to resume it, add dataloader to checkpoint.exclude_from_loading to start this data at its first "
               "sample, or pick another job.dump_folder")
    cases = [(["--training.seed", "1"], f"training.seed: 1, but the checkpoint at {ckpt} counted its data position in "
                                        f"samples in the order of seed 0; set --training.seed 0 {way_out}"),
             (["--training.seq_len", "64"], f"training.seq_len: 64, but the checkpoint at {ckpt} counted its data "
                                            f"position in windows of seq_len 32; set --training.seq_len 32 {way_out}"),
             (["--training.dataset", "files", "--training.dataset_path", str(docs)],
              f"training.dataset: 'files', but the checkpoint at {ckpt} counted its data position in samples of the "
              f"dataset 'stdlib'; set --training.dataset stdlib {way_out}")]
    for change, line in cases:
        argv = merge(BASE, ["--training.steps", "6", "--job.dump_folder", str(dump), *CKPT], change)
        with pytest.raises(ConfigError) as err:
            validate(parse_args(argv), 1)
        assert str(err.value) == line
        validate(parse_args([*argv, "--checkpoint.exclude_from_loading", "dataloader"]), 1)
    assert _main("--job.dump_folder", str(dump), *CKPT, "--training.steps", "6", "--training.seed", "1") == 2
    assert capsys.readouterr().err == f"tessera: {cases[0][1]}\n"
    assert _snapshot(dump) == before
    longer = run_train(["--job.dump_folder", str(dump), *CKPT, "--training.seq_len", "64",
                        "--checkpoint.exclude_from_loading", "dataloader"], 6)
    assert longer["start"] == 4 and [sorted(longer["samples"][s]) for s in (5, 6)] == global_batch_ids(
        merge(BASE, ["--training.seq_len", "64"]), 8, 2)  # the new windows from the first


def test_a_streamed_dataset_read_from_another_path_resumes_with_a_warning(caplog):
    """The same documents may have moved (a copy on a faster disk): named in one line, not refused."""
    from tessera.preflight.resume import check_resumed_data
    from tessera.schema import parse_args

    cfg = parse_args(["--training.dataset", "files", "--training.dataset_path", "/fast/docs"])
    saved = {"dataset": "files", "dataset_path": "/slow/docs", "seed": 0, "seq_len": 2048, "data_streams": 64}
    check_resumed_data(cfg, "ckpt/step-4", saved)
    assert [r.getMessage() for r in caplog.records] == [
        "training.dataset_path: '/fast/docs', but the checkpoint at ckpt/step-4 read '/slow/docs'; its data position "
        "is resumed as a position in the same documents (add dataloader to checkpoint.exclude_from_loading to start "
        "this data at its first sample)"]


def _remark(step: Path) -> None:
    """The completion marker of a checkpoint whose files a test edited, as if they had been written so."""
    from tessera.checkpoint.folder import write_marker

    write_marker(str(step), int(step.name.split("-")[1]), "full")


def test_older_checkpoints_are_checked_by_flavor_and_shapes(tmp_path, capsys):
    dump = tmp_path / "run"
    run_train(["--job.dump_folder", str(dump), *CKPT], 4)
    step = dump / "checkpoint/step-4"
    os.remove(step / "model.json")  # as written before checkpoints recorded their architecture
    _remark(step)
    assert _main("--job.dump_folder", str(dump), *CKPT, "--model.flavor", "debugmodel") == 2
    assert "was written by flavor 'tiny', not 'debugmodel'" in capsys.readouterr().err
    config = step / "config.toml"
    config.write_text(config.read_text().replace('flavor = "tiny"', 'flavor = "debugmodel"'))
    _remark(step)
    assert _main("--job.dump_folder", str(dump), *CKPT, "--model.flavor", "debugmodel") == 2
    assert "holds 'tok_embeddings.weight' with shape [258, 64], the model asked for has [258, 256]" in \
        capsys.readouterr().err


def test_an_empty_flavor_resumes_the_checkpoints_architecture(tmp_path):
    dump = tmp_path / "run"
    run_train(["--job.dump_folder", str(dump), *CKPT], 4)
    more = run_train(["--job.dump_folder", str(dump), *CKPT, "--model.flavor", ""], 6)
    assert more["start"] == 4 and more["params"]["tok_embeddings.weight"].shape == (258, 64)


def test_folders_that_cannot_be_written_are_refused_before_training(tmp_path, capsys, monkeypatch):
    from tessera.checkpoint.manager import probe_writable
    from tessera.config import ConfigError

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert _main("--job.dump_folder", str(blocker / "run")) == 2
    assert f"job.dump_folder: '{blocker}' is a file" in capsys.readouterr().err
    assert _main("--job.dump_folder", str(tmp_path / "ok"), *CKPT, "--checkpoint.folder", "a/../../a_file/x") == 2
    assert "checkpoint.folder:" in capsys.readouterr().err
    assert _main("--job.dump_folder", str(tmp_path / "ok"), *CKPT, "--checkpoint.folder", "../x") == 2
    assert capsys.readouterr().err.strip() == ("tessera: checkpoint.folder: '../x' leads out of job.dump_folder; name "
                                               "a folder inside it, or an absolute path for checkpoints kept elsewhere")
    assert not (tmp_path / "x").exists() and not (tmp_path / "ok").exists()
    # Permission bits say yes to root everywhere; creating a file is what tells. (As any user: os.access says yes.)
    monkeypatch.setattr(os, "access", lambda *a, **kw: True)
    assert _main("--job.dump_folder", "/proc/tessera-run") == 2
    assert capsys.readouterr().err.startswith("tessera: job.dump_folder: '/proc' is not writable (")
    with pytest.raises(ConfigError, match="GiB free, but one checkpoint of this model needs about"):
        probe_writable(str(tmp_path / "room"), need_bytes=2**62)


def test_a_failed_validation_comes_after_the_save(tmp_path, monkeypatch):
    import tessera.train as train_module

    def broken(tr):
        raise RuntimeError("validation broke")

    monkeypatch.setattr(train_module, "validate_loss", broken)
    with pytest.raises(RuntimeError, match="validation broke"):
        run_train(["--job.dump_folder", str(tmp_path), *CKPT, "--validation.enable", "--validation.freq", "4"], 4)
    assert (tmp_path / "checkpoint/step-4/.complete").is_file()


BAD_VALUES = [
    (["--optimizer.lr", "inf"], "optimizer.lr (on the command line): inf is infinite"),
    (["--optimizer.lr", "nan"], "optimizer.lr (on the command line): nan is not a number"),
    (["--optimizer.beta1", "1.0"], "optimizer.beta1 (on the command line): 1.0 must be below 1.0"),
    (["--optimizer.beta2", "-0.1"], "optimizer.beta2 (on the command line): -0.1 is below the minimum 0.0"),
    (["--training.seed", str(2**64)], "training.seed (on the command line): 18446744073709551616 is above the maximum"),
    (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio (on the command line): 1.5 is above the maximum"),
    (["--lr_scheduler.min_lr_factor", "5"], "lr_scheduler.min_lr_factor (on the command line): 5.0 is above the"),
    (["--compile.enable", "--compile.components", ""], "compile.components: empty while compile.enable = true"),
    (["--job.dump_folder", ""], "job.dump_folder: empty"),
    (["--job.config_file", "configs"], "job.config_file: 'configs' is a folder"),
    (["--checkpoint.initial_load_path", "configs"], "checkpoint.initial_load_path: set, but checkpoint.enable = false"),
    (["--checkpoint.enable", "--checkpoint.initial_load_in_hf"], "checkpoint.initial_load_in_hf: set without"),
    (["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", "nowhere"],
     "checkpoint.initial_load_path: no such folder 'nowhere'"),
    (["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", "configs"],
     "checkpoint.initial_load_path: no config.json in 'configs': the weights' architecture is unknown"),
]


@pytest.mark.parametrize("argv, expect", BAD_VALUES, ids=[a[0][2:] + (a[1:] or [""])[0] for a, _ in BAD_VALUES])
def test_bad_values_are_refused_before_any_rank_starts(argv, expect):
    base = ["--model.flavor", "tiny", "--training.steps", "5", "--lr_scheduler.warmup_steps", "2"]
    proc = subprocess.run([sys.executable, "-m", "tessera.config", *merge(base, argv)], env=ENV, capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and expect in proc.stderr


def test_a_key_given_twice_is_refused():
    from tessera.config import ConfigError
    from tessera.schema import parse_args

    with pytest.raises(ConfigError, match="--training.steps is given twice on the command line; keep one"):
        parse_args(["--training.steps", "3", "--training.steps=4"])


@pytest.mark.ranks
def test_ngpu_is_named_as_ngpu():
    proc = subprocess.run(["./run_train.sh"], env={**ENV, "NGPU": "two"}, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "tessera: NGPU: expected a positive integer (processes on this node), got 'two'" in proc.stderr


@pytest.mark.ranks
def test_an_error_after_ranks_start_is_one_line_with_its_status(tmp_path):
    """Under tessera.launch (what run_train.sh and the SLURM script use): no torchrun failure block."""
    cmd = [sys.executable, "-m", "tessera.launch", "--standalone", "--nproc_per_node=2", "-m", "tessera.train",
           *merge(BASE, ["--training.steps", "4", "--job.dump_folder", str(tmp_path), "--optimizer.lr", "nan"])]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert lines == ["tessera: optimizer.lr (on the command line): nan is not a number; give a finite number"], lines
    assert not list(tmp_path.iterdir())


def _data_files(tmp: Path) -> dict[str, str]:
    (tmp / "empty.txt").write_text("")
    (tmp / "small.txt").write_text("one short document")
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # a download cut short
    (tmp / "garbage.jsonl").write_text("".join(f'{{"text": "document {k}"}}\n' if k % 4 == 0 else "<html>\n"
                                               for k in range(200)))  # mostly bad: read at the launch, not mid-run
    return {"empty": str(tmp / "empty.txt"), "small": str(tmp / "small.txt"), "tok": str(tmp / "tok"),
            "garbage": str(tmp / "garbage.jsonl")}


BAD_DATA = [
    (["--training.dataset", "wikitext"], {}, "training.dataset: unknown dataset 'wikitext'; use stdlib, files"),
    (["--training.dataset_path", "{small}"], {}, "training.dataset_path: '{small}' is given, but "
                                                      "training.dataset = 'stdlib' reads the built-in corpus"),
    (["--training.dataset", "files", "--training.dataset_path", "{empty}"], {},
     "training.dataset_path: no text in {empty}: every document is empty"),
    (["--training.dataset", "files", "--training.dataset_path", "{small}", "--validation.enable"], {},
     "validation.enable: the validation split of {small} is empty"),
    (["--model.hf_assets_path", "{tok}"], {}, "model.hf_assets_path: {tok}/tokenizer.json is not valid JSON"),
    (["--training.dataset", "files", "--training.dataset_path", "{garbage}", "--training.max_bad_records", "20"], {},
     "tessera: training.max_bad_records: 150 of the first 200 records of {garbage} are bad; at that rate about 150 "
     "of the ~200 records this run reads would be, more than 20; the first: {garbage}:2: not valid JSON (Expecting "
     "value at column 1); {garbage}:3: not valid JSON (Expecting value at column 1); {garbage}:4: not valid JSON "
     "(Expecting value at column 1); write one JSON object per line (.jsonl), or one JSON array of objects (.json), "
     "each with its text in the string field 'text', or raise training.max_bad_records (-1: no limit)"),
    (["--training.dataset", "org/corpus"], {"HF_HUB_OFFLINE": "1"},
     "training.dataset: 'org/corpus' streams 'org/corpus' from the Hugging Face Hub, but the machine is offline"),
    (["--training.dataset", "c4"], {"HF_ENDPOINT": "http://127.0.0.1:9"},
     "streams 'allenai/c4' from the Hugging Face Hub, but the Hub at http://127.0.0.1:9 does not answer"),
]


@pytest.mark.parametrize("argv, env, expect", BAD_DATA, ids=[str(i) for i in range(len(BAD_DATA))])
def test_bad_data_is_refused_in_one_line(argv, env, expect, tmp_path):
    """Before any rank starts (the pre-check); the Hub, which a config check offline must not need, by each rank
    as it opens the stream, within seconds."""
    files = _data_files(tmp_path)
    argv = merge(BASE, ["--training.steps", "4", "--job.dump_folder", str(tmp_path / "run")],
                 [a.format(**files) for a in argv])
    hub = "Hub" in expect
    cmd = ["-m", "tessera.train" if hub else "tessera.config", *argv]
    proc = subprocess.run([sys.executable, *cmd], env={**ENV, **env}, capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expect.format(**files) in proc.stderr
    assert not (tmp_path / "run").exists()


def test_bad_records_mid_run_are_skipped_and_counted_or_stop_the_run(tmp_path, capsys):
    # Past the first 1,000 records, which the launch samples: one stream of 4 x 8 windows of 257 tokens reads them.
    docs = [json.dumps({"text": f"d{k}"}) for k in range(1100)]
    docs[1025], docs[1030] = '{"text": 3}', '{"text": "unfinished'
    (tmp_path / "d.jsonl").write_text("\n".join(docs) + "\n")
    data = ["--training.dataset", "files", "--training.dataset_path", str(tmp_path / "d.jsonl"),
            "--training.data_streams", "1", "--training.seq_len", "256"]
    assert _main("--job.dump_folder", str(tmp_path / "ok"), *data) == 0
    assert "2 bad data record(s) skipped (training.max_bad_records = 100); the first, " \
           f"{tmp_path / 'd.jsonl'}:1026: 'text' is a number, not a string" in capsys.readouterr().out
    assert _main("--job.dump_folder", str(tmp_path / "strict"), *data, "--training.max_bad_records", "1") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"tessera: training.max_bad_records: 2 bad data records, more than 1; the latest, {tmp_path / 'd.jsonl'} "
        f"line 1031: not valid JSON (Invalid control character at column 21); fix the data, or raise "
        f"training.max_bad_records (-1: no limit)"]
