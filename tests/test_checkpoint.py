"""Checkpoints: exact and elastic resume, fault tolerance, corruption, async, retention, seed, exports."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import warnings
import zlib

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tessera.checkpoint.folder import DIGEST, digest_file
from tessera.config import ConfigError
from tessera.data import build_dataloader, build_tokenizer
from tessera.schema import parse_args
from tests.dist_worker import BASE, run_train
from tests.launch import ROOT, resume_copy, run_cases

STEPS = 12
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]


def _params_equal(a: dict, b: dict, tol: float = 0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")


def _export(path) -> dict:
    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def test_exact_resume_single_process(tmp_path):
    full = run_train(["--job.dump_folder", str(tmp_path / "full"), *CKPT], STEPS)
    resumed = run_train(["--job.dump_folder", str(resume_copy(tmp_path / "full", tmp_path / "r", 4)), *CKPT], STEPS)
    assert resumed["start"] == 4
    assert [resumed["losses"][s] for s in range(5, STEPS + 1)] == [full["losses"][s] for s in range(5, STEPS + 1)]
    _params_equal(resumed["params"], full["params"])  # bit for bit


def test_resumes_a_checkpoint_holding_the_training_state_as_bytes(tmp_path, monkeypatch):
    """Checkpoints hold the training state as a uint8 tensor (torch.load's weights_only refuses DCP's BytesIO in
    dcp_to_torch_save's output); those from before, holding it as bytes, still resume exactly."""
    import io

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from tessera.checkpoint import manager

    def bytes_blob(train: dict) -> io.BytesIO:
        blob = io.BytesIO()
        torch.save(train, blob)
        blob.seek(0)
        return blob

    monkeypatch.setattr(manager, "train_blob", bytes_blob)
    ckpt = [*CKPT, "--checkpoint.interval", "2"]
    full = run_train(["--job.dump_folder", str(tmp_path / "full"), *ckpt], 4)
    monkeypatch.undo()
    old = tmp_path / "full/checkpoint/step-2"
    assert isinstance(FileSystemReader(str(old)).read_metadata().state_dict_metadata["train"], BytesStorageMetadata)
    resumed = run_train(["--job.dump_folder", str(resume_copy(tmp_path / "full", tmp_path / "r", 2)), *ckpt], 4)
    assert resumed["start"] == 2 and resumed["losses"] == {s: full["losses"][s] for s in (3, 4)}
    _params_equal(resumed["params"], full["params"])
    dcp_to_torch_save(str(tmp_path / "r/checkpoint/step-4"), str(tmp_path / "step-4.pt"))
    saved = torch.load(tmp_path / "step-4.pt")  # weights_only, the default
    assert saved["train"].dtype == torch.uint8 and manager.read_train(saved["train"])["train_state"]["step"] == 4


def global_batch_ids(argv: list[str], global_batch: int, steps: int) -> list[list[int]]:
    """Per step, the sorted ids (as tests/dist_worker.py's) of the global batch, read by one rank holding it all."""
    cfg = parse_args([*argv, "--training.local_batch_size", str(global_batch)])
    loader = build_dataloader(cfg, build_tokenizer(cfg.model.hf_assets_path), 0, 1)
    return [sorted(zlib.crc32(row.numpy().tobytes()) for row in loader.next_batch()[0]) for _ in range(steps)]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A 2-rank FSDP run with checkpoints every 4 steps, saved asynchronously (the torchrun tests save in step):
    the source of the resume tests below."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    (res,) = run_cases(2, [["--job.dump_folder", str(tmp / "run"), "--training.local_batch_size", "4", *CKPT,
                                 "--checkpoint.async_mode", "async"]], STEPS, mode="train")
    return tmp / "run", res


@pytest.mark.ranks
def test_exact_resume_two_ranks_and_elastic_to_one_and_four(tmp_path, two_rank_run):
    src, full = two_rank_run
    step = src / "checkpoint/step-4"  # each rank's shard hashed as written, every digest gathered to rank 0
    marker = json.loads((step / ".complete").read_text())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "config.toml", "model.json"} == set(marker[DIGEST])
    assert marker[DIGEST] == {name: digest_file(str(step / name)) for name in marker["files"]}
    same = ["--job.dump_folder", str(resume_copy(src, tmp_path / "r2", 4)), "--training.local_batch_size", "4", *CKPT]
    (exact,) = run_cases(2, [same], STEPS, mode="train")
    one = run_train(["--job.dump_folder", str(resume_copy(src, tmp_path / "r1", 4)),
                     "--training.local_batch_size", "8", *CKPT], STEPS)
    (four,) = run_cases(4, [["--job.dump_folder", str(resume_copy(src, tmp_path / "r4", 4)),
                                       "--training.local_batch_size", "2", *CKPT]], STEPS, mode="train")
    later = range(5, STEPS + 1)
    assert exact["start"] == one["start"] == four["start"] == 4
    assert [exact["losses"][s] for s in later] == [full["losses"][s] for s in later]
    _params_equal(exact["params"], full["params"])
    for run in (one, four):  # another reduction order: equal to fp32 rounding
        for s in later:
            assert abs(run["losses"][s] - full["losses"][s]) < 1e-5
        _params_equal(run["params"], full["params"], tol=1e-5)
        # The data continues exactly: each step sees the same samples, none twice, none skipped.
        for s in later:
            assert sorted(run["samples"][s]) == sorted(full["samples"][s])
    # ...and the uninterrupted run took global samples 8(s-1) .. 8s-1 at step s: none twice, none skipped.
    assert [sorted(full["samples"][s]) for s in range(1, STEPS + 1)] == global_batch_ids(BASE, 8, STEPS)


def _torchrun_train(dump, *extra, env=None):
    """tessera.train on 2 ranks; with `env`, through tests/faults.py, which injects the faults it names."""
    program = [str(ROOT / "tests/faults.py")] if env else ["-m", "tessera.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *program,
           *BASE, "--training.steps", str(STEPS), "--training.local_batch_size", "4", "--job.dump_folder", str(dump),
           "--checkpoint.enable", "--checkpoint.interval", "3", *extra]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun puts its workers in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    stack, tree = [pid], []
    while stack:
        tree.append(stack.pop())
        stack.extend(children.get(tree[-1], []))
    for p in reversed(tree):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.ranks
def test_sigkill_mid_run_and_during_save_then_relaunch(tmp_path):
    ref = _torchrun_train(tmp_path / "ref")
    assert ref.wait(timeout=300) == 0, ref.stdout.read()[-3000:]
    kill_at = 5  # after the step-3 save, before the step-9 save the second crash interrupts
    # Held before the next step (tests/faults.py) until the kill, however late this process reads the output.
    run = _torchrun_train(tmp_path / "run", env={"TESSERA_TEST_HOLD": f"{kill_at + 1}:{tmp_path / 'never'}"})
    for line in run.stdout:  # SIGKILL the whole job once it logs step `kill_at`
        if f"step {kill_at:>2}/{STEPS}" in line:
            _kill_tree(run.pid)
            break
    assert run.wait(timeout=60) != 0 and not (tmp_path / f"run/checkpoint/step-{STEPS}").exists()
    crash = _torchrun_train(tmp_path / "run", env={"TESSERA_TEST_KILL_BEFORE_MARKER": "9"})
    out = crash.stdout.read()
    assert crash.wait(timeout=300) != 0 and not (tmp_path / "run/checkpoint/step-9/.complete").exists(), out[-2000:]
    again = _torchrun_train(tmp_path / "run")
    out = again.stdout.read()
    assert again.wait(timeout=300) == 0, out[-3000:]
    assert out.count("skipping checkpoint step 9") == 1 and "resumed from checkpoint step 6" in out  # rank 0 alone
    _params_equal(*(_export(tmp_path / f"{run}/checkpoint/exports/step-{STEPS}")["model"] for run in ("run", "ref")))


@pytest.fixture
def skipped():
    """The "skipping checkpoint" warnings logged while the test runs (whatever the root logger's handlers)."""
    found: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: found.append(record.getMessage()) if "skipping" in record.getMessage() else None
    logger = logging.getLogger("tessera")
    logger.addHandler(handler)
    yield found
    logger.removeHandler(handler)


def test_corrupt_checkpoint_falls_back_or_names_the_file(tmp_path, capsys, skipped):
    from tessera.train import main

    dump = tmp_path / "run"
    run_train(["--job.dump_folder", str(dump), *CKPT, "--checkpoint.last_save_model_only=false"], 8)
    shard = dump / "checkpoint/step-8/__0_0.distcp"
    written = os.path.getsize(shard)
    with open(shard, "r+b") as fh:
        fh.truncate(written // 2)
    code = main([*BASE, "--job.dump_folder", str(dump), *CKPT, "--training.steps", "8", "--checkpoint.load_step", "8"])
    assert code == 2 and f"step 8 at {dump}/checkpoint/step-8 is not usable: {shard} has" in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run_train(["--job.dump_folder", str(resume_copy(dump, tmp_path / "copy", 8)), *CKPT], 8)
    assert resumed["start"] == 4  # fell back past the truncated step 8, then saved step 8 afresh, not over it
    assert os.path.getsize(tmp_path / "copy/checkpoint/damaged/step-8/__0_0.distcp") == written // 2  # set aside
    assert not [w for w in caught if "overwrit" in str(w.message)], [str(w.message) for w in caught]
    skipped.clear()  # a whole launch (its pre-check, then the rank's look-up) says it once
    assert main([*BASE, "--job.dump_folder", str(resume_copy(dump, tmp_path / "main", 8)), *CKPT,
                 "--training.steps", "8"]) == 0
    assert skipped == [f"skipping checkpoint step 8 ({tmp_path}/main/checkpoint/step-8/__0_0.distcp has "
                       f"{written // 2} bytes, {written} were written); falling back "
                       f"to an earlier one"], skipped
    os.remove(dump / "checkpoint/step-4/.metadata")
    with pytest.raises(ConfigError, match=f"every checkpoint under {dump}/checkpoint is damaged"):
        run_train(["--job.dump_folder", str(dump), *CKPT], 2)  # nothing intact is left: not a silent restart


def _flip_middle(file, count: int = 256) -> None:
    """Damage a file in place: `count` bytes in its middle inverted, its size unchanged."""
    size = os.path.getsize(file)
    with open(file, "r+b") as fh:
        fh.seek(size // 2)
        data = fh.read(count)
        fh.seek(size // 2)
        fh.write(bytes(b ^ 0xFF for b in data))
    assert os.path.getsize(file) == size


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_damaged_in_place_falls_back_and_keep_latest_k_keeps_the_good_one(tmp_path, skipped, capsys, mode):
    from tessera.train import main

    saves = [*CKPT, "--checkpoint.async_mode", mode, "--checkpoint.last_save_model_only=false"]
    ref = run_train(["--job.dump_folder", str(tmp_path / "ref"), *saves, "--checkpoint.interval", "2"], 6)
    dump = resume_copy(tmp_path / "ref", tmp_path / "run", 4)  # steps 2 and 4, as if the run had stopped there
    step4 = dump / "checkpoint/step-4"
    marker = json.loads((step4 / ".complete").read_text())
    assert marker[DIGEST] == {name: digest_file(str(step4 / name)) for name in marker["files"]}  # as written
    shard = step4 / "__0_0.distcp"
    _flip_middle(shard)
    # Saves at 3 and 6 keeping 2: the damaged step 4 must neither be resumed nor count among the 2 kept.
    resumed = run_train(["--job.dump_folder", str(dump), *saves, "--checkpoint.keep_latest_k", "2",
                         "--checkpoint.interval", "3"], 6)
    assert len(skipped) == 1 and skipped[0].startswith(f"skipping checkpoint step 4 ({shard} changed after it was "
                                                       f"written (its {DIGEST} is "), skipped
    assert resumed["start"] == 2  # the previous verified checkpoint
    assert [resumed["losses"][s] for s in range(3, 7)] == [ref["losses"][s] for s in range(3, 7)]  # good weights
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-3", "step-6"]
    if mode == "disabled":  # an explicit load_step of the damaged one is refused, in one line
        _flip_middle(tmp_path / "ref/checkpoint/step-4/__0_0.distcp")
        code = main([*BASE, "--job.dump_folder", str(tmp_path / "ref"), *CKPT, "--training.steps", "6",
                     "--checkpoint.load_step", "4"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(
            f"tessera: checkpoint.load_step: step 4 at {tmp_path}/ref/checkpoint/step-4 is not usable: "
            f"{tmp_path}/ref/checkpoint/step-4/__0_0.distcp changed after it was written"), err


def test_damaged_export_and_seed_are_refused_or_skipped(tmp_path, capsys, skipped):
    """A damaged export is refused by convert, from_pretrained and initial_load_path, a damaged seed skipped; a step
    folder whose save did not finish (no marker) is refused by convert, tessera.eval, tessera.generate and
    initial_load_path, naming it, as resume skips it."""
    from tessera import convert
    from tessera.eval.__main__ import main as evaluate
    from tessera.generate import from_pretrained, main as generate
    from tessera.train import main

    run_train(["--job.dump_folder", str(tmp_path / "run"), *CKPT], 2)  # the final save exports the model too
    export = tmp_path / "run/checkpoint/exports/step-2"
    assert set(json.loads((export / ".complete").read_text())[DIGEST]) >= {"__0_0.distcp", ".metadata"}
    old = export.parent / "old"  # a marker of sizes alone, as written before checksums: loads, checked by size
    shutil.copytree(export, old)
    marker = json.loads((old / ".complete").read_text())
    (old / ".complete").write_text(json.dumps({k: v for k, v in marker.items() if k != DIGEST}))
    assert from_pretrained(old)[0] is not None
    _flip_middle(export / "__0_0.distcp")
    named = f"'{export}' is damaged: {export}/__0_0.distcp changed after it was written"
    with pytest.raises(SystemExit, match="2"):
        convert.main(["dcp-to-torch", str(export), str(tmp_path / "out.pt")])
    assert named in capsys.readouterr().err and not (tmp_path / "out.pt").exists()
    with pytest.raises(Exception, match=named):
        from_pretrained(export)
    code = main([*BASE, "--job.dump_folder", str(tmp_path / "from_export"), "--checkpoint.enable",
                 "--checkpoint.initial_load_path", str(export), "--training.steps", "2"])
    assert code == 2 and f"checkpoint.initial_load_path: {named}" in capsys.readouterr().err
    unfinished = tmp_path / "cut/step-2"  # its files all there, the save stopped before the marker
    shutil.copytree(tmp_path / "run/checkpoint/step-2", unfinished)
    (unfinished / ".complete").unlink()
    said = f"'{unfinished}' is unfinished: no .complete marker: its save was interrupted; pick another checkpoint"
    with pytest.raises(SystemExit, match="2"):
        convert.main(["dcp-to-hf", str(unfinished), str(tmp_path / "hf")])
    assert capsys.readouterr().err == f"python -m tessera.convert: error: {said}\n"
    assert not (tmp_path / "hf").exists()
    load = ["--checkpoint.initial_load_path", str(unfinished)]
    assert evaluate([*load, "--eval.tasks", str(ROOT / "tests/eval_tasks/mc.yaml")]) == 2
    assert capsys.readouterr().err == f"tessera.eval: checkpoint: {said}\n"
    assert generate(load) == 2 and capsys.readouterr().err == f"tessera.generate: checkpoint: {said}\n"
    code = main([*BASE, "--job.dump_folder", str(tmp_path / "from_cut"), "--checkpoint.enable", *load,
                 "--training.steps", "2"])
    assert code == 2 and capsys.readouterr().err == f"tessera: checkpoint.initial_load_path: {said}\n"
    seed = tmp_path / "seed"
    assert main([*BASE, "--job.dump_folder", str(seed), "--checkpoint.enable",
                 "--checkpoint.create_seed_checkpoint"]) == 0
    assert DIGEST in json.loads((seed / "checkpoint/step-0/.complete").read_text())
    _flip_middle(seed / "checkpoint/step-0/__0_0.distcp")
    with pytest.raises(ConfigError, match=f"every checkpoint under {seed}/checkpoint is damaged"):
        run_train(["--job.dump_folder", str(seed), "--checkpoint.enable"], 2)
    skipped.clear()
    assert run_train(["--job.dump_folder", str(seed), "--checkpoint.enable",
                      "--checkpoint.start_fresh_if_all_damaged"], 2)["start"] == 0
    assert len(skipped) == 1 and skipped[0].startswith(
        f"skipping checkpoint step 0 ({seed}/checkpoint/step-0/__0_0.distcp changed after it was written")


def test_ranks_resume_the_planned_checkpoint_and_one_process_reads_it_once(tmp_path, monkeypatch):
    """The ranks load the checkpoint their pre-check planned (validate's `resume`), not one they choose again; a
    one-process run, whose pre-check has read that checkpoint whole against its checksums, does not read it again."""
    from tessera.checkpoint import folder
    from tessera.checkpoint.resume import confirm_resume
    from tessera.preflight import validate
    from tessera.train import main

    dump = tmp_path / "run"
    run_train(["--job.dump_folder", str(dump), *CKPT], 4)
    reads, digest = [], folder.digest_file
    monkeypatch.setattr(folder, "digest_file", lambda file: reads.append(file) or digest(file))
    assert main([*BASE, "--job.dump_folder", str(dump), *CKPT, "--training.steps", "5"]) == 0
    step4 = [file for file in reads if "/step-4/" in file]
    assert step4 and sorted(step4) == sorted(set(step4)), step4  # each file once
    run = validate(parse_args([*BASE, "--job.dump_folder", str(dump), *CKPT, "--training.steps", "8"]), 1,
                   training=True)  # a rank's pre-check: by sizes
    assert (run.resume.step, run.resume.content_checked) == (5, False)
    shutil.copytree(dump / "checkpoint/step-5", dump / "checkpoint/step-6")  # appears after the plan
    damaged: set[str] = set()
    assert confirm_resume(run.cfg, run.resume, run.damaged, damaged)[0] == 5 and not damaged
    _flip_middle(dump / "checkpoint/step-5/__0_0.distcp")  # damaged since the plan: the content check finds it
    assert confirm_resume(run.cfg, run.resume, run.damaged, damaged)[0] == 6  # an intact one, looked up again
    assert damaged == {str(dump / "checkpoint/step-5")}


def test_each_run_says_each_skip_once(tmp_path, skipped):
    """What a run has warned is the run's, not the process's: a run's repeated look-ups (a content check that
    fails sends it back to the folders) say each skip once, and the next run in the same process says them again."""
    from tessera.checkpoint.folder import write_marker
    from tessera.checkpoint.resume import find_resume

    root = tmp_path / "checkpoint"
    for step in (2, 4, 5):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}/shard").write_bytes(bytes(range(256)))
        if step != 5:  # step 5's save was interrupted before its marker
            write_marker(str(root / f"step-{step}"), step, "full")
    _flip_middle(root / "step-4/shard", 16)  # size unchanged: only the content check finds it
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable"])
    for run in range(2):
        skipped.clear()
        assert find_resume(cfg)[0] == 2
        assert [line.split(" (")[0] for line in skipped] == ["skipping checkpoint step 5",
                                                             "skipping checkpoint step 4"], (run, skipped)


@pytest.mark.fast
def test_a_corrupt_marker_is_called_corrupt(tmp_path, skipped):
    from tessera.checkpoint.folder import damage, write_marker
    from tessera.checkpoint.resume import find_resume

    root = tmp_path / "checkpoint"
    for step in (2, 3):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}/shard").write_bytes(bytes(range(256)))
        write_marker(str(root / f"step-{step}"), step, "full")
    (root / "step-3/.complete").write_text('{"step": 3, "files": {"sha')  # cut short
    assert find_resume(parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable"]))[0] == 2
    assert skipped == ["skipping checkpoint step 3 (its .complete marker is corrupt (not the JSON record Tessera "
                       "writes), so its files cannot be checked); falling back to an earlier one"]
    assert "is damaged: its .complete marker is corrupt" in damage(str(root / "step-3"))  # not taken as unmarked


def test_async_contents_equal_sync_and_keep_latest_k(tmp_path):
    for mode in ("disabled", "async"):
        run_train(["--job.dump_folder", str(tmp_path / mode), *CKPT, "--checkpoint.async_mode", mode,
                   "--checkpoint.keep_latest_k", "2", "--checkpoint.interval", "2"], 8)
        assert sorted(os.listdir(tmp_path / mode / "checkpoint")) == ["exports", "step-6", "step-8"]
    sync, asyn = _export(tmp_path / "disabled/checkpoint/step-6"), _export(tmp_path / "async/checkpoint/step-6")
    assert sync.keys() == asyn.keys() and "optimizer" in sync
    flat = lambda d: {k: v for k, v in d["model"].items()}  # noqa: E731
    _params_equal(flat(sync), flat(asyn))
    metrics = [json.loads(x) for x in (tmp_path / "async/metrics.jsonl").read_text().splitlines()]
    assert all("checkpoint_stall_s" in m for m in metrics if "loss" in m)


@pytest.mark.ranks
def test_seed_checkpoint_loaded_by_two_ranks(tmp_path):
    from tessera.train import main
    seed_dir = tmp_path / "seed"
    assert main([*BASE, "--job.dump_folder", str(seed_dir), "--checkpoint.enable",
                 "--checkpoint.create_seed_checkpoint", "--training.seed", "7"]) == 0
    assert (seed_dir / "checkpoint/step-0/.complete").exists()
    shutil.copytree(seed_dir, tmp_path / "one")
    one = run_train(["--job.dump_folder", str(tmp_path / "one"), "--checkpoint.enable"], 3)
    shutil.copytree(seed_dir, tmp_path / "two")
    (two,) = run_cases(2, [["--job.dump_folder", str(tmp_path / "two"), "--checkpoint.enable",
                                      "--training.local_batch_size", "4"]], 3, mode="train")
    fresh = run_train(["--job.dump_folder", str(tmp_path / "fresh")], 3)
    assert all(abs(two["losses"][s] - one["losses"][s]) < 1e-5 for s in (1, 2, 3))
    assert abs(fresh["losses"][1] - one["losses"][1]) > 1e-4  # the seed checkpoint, not a fresh init, was used


def test_bf16_model_only_export_and_dcp_to_torch_cli(tmp_path):
    dump = tmp_path / "run"
    res = run_train(["--job.dump_folder", str(dump), *CKPT, "--checkpoint.export_dtype", "bfloat16"], 4)
    out = tmp_path / "final.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                           str(dump / "checkpoint/exports/step-4"), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(out, weights_only=False)
    assert set(saved) == {"model"}
    for name, value in saved["model"].items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value, res["params"][name].to(torch.bfloat16), rtol=0, atol=0)


def test_exclude_from_loading_restarts_that_part(tmp_path):
    full = run_train(["--job.dump_folder", str(tmp_path / "full"), *CKPT], 8)
    resumed = run_train(["--job.dump_folder", str(resume_copy(tmp_path / "full", tmp_path / "r", 4)), *CKPT,
                         "--checkpoint.exclude_from_loading", "dataloader"], 8)
    assert resumed["start"] == 4
    assert resumed["samples"][5] == full["samples"][1]  # the data stream started over; the model did not
    assert resumed["losses"][5] != full["losses"][1]
