"""Prepared datasets: `python -m tessera.data.prepare` (sharded token files, deterministic, resumable, on datatrove's
local and SLURM executors) and training from them (order independent of layout, O(1) resume, mixtures, bad input),
and document masking under context parallelism."""

import json
import os
import stat
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tessera.config import ConfigError
from tessera.data import build_dataloader, build_tokenizer, prepare, tokens
from tessera.data.prepared import BLOCK, PreparedLoader, permute
from tessera.data.tokenizer import ByteTokenizer
from tessera.data.tokens import TokenShards, read_manifest
from tessera.preflight import validate
from tessera.schema import parse_args
from tests.dist_worker import run_train
from tests.launch import ROOT, merge, resume_copy, run_cases, run_local

B, E = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def write_corpus(folder: Path, n: int = 400, tag: str = "doc") -> list[str]:
    """A .jsonl of n short documents (several fit a 33-token window), a bad line among them, and a .parquet and a
    .txt; returns the texts a prepare must keep, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = [f"{tag} {k}: " + "ab cd " * (k % 5) for k in range(n)]
    lines = [json.dumps({"text": t}) for t in texts]
    lines.insert(n // 2, "{not json")
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": [f"{tag} row {k}" for k in range(50)]}), folder / "b.parquet", row_group_size=10)
    (folder / "c.txt").write_text(f"{tag} the text file\n")
    return texts + [f"{tag} row {k}" for k in range(50)] + [f"{tag} the text file\n"]


def run_prepare(corpus: Path, out: Path, *extra: str) -> int:
    return prepare.main(["--input", str(corpus), "--output", str(out), "--piece_mb", "0.004", "--tasks", "3",
                         "--workers", "1", *extra])


def documents_of(folder: Path, split: str) -> list[list[int]]:
    manifest = read_manifest(str(folder))
    docs = []
    for shard in manifest["splits"][split]["shards"]:
        ids = np.fromfile(folder / shard["file"], dtype=manifest["dtype"])
        offsets = np.fromfile(folder / shard["file"].replace(".bin", ".idx"), dtype=np.int64)
        docs += [ids[a:b].tolist() for a, b in zip(offsets, offsets[1:], strict=False)]
    return docs


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and ".prepare" not in p.parts}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A corpus and its prepare (byte tokenizer, 3 tasks, the .jsonl cut in pieces)."""
    tmp = tmp_path_factory.mktemp("prepared")
    texts = write_corpus(tmp / "corpus")
    assert run_prepare(tmp / "corpus", tmp / "out") == 0
    return tmp, texts


# --- prepare --------------------------------------------------------------------------------------------------

def test_prepare_keeps_every_document_once_and_holds_out_by_hash(prepared, capsys):
    tmp, texts = prepared
    manifest = read_manifest(str(tmp / "out"))
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["fingerprint"] == "byte"
    assert manifest["tasks"] == 3 and len({s["file"][6:11] for s in manifest["splits"]["train"]["shards"]}) == 3
    assert manifest["bad_records"]["count"] == 1 and "a.jsonl:" in manifest["bad_records"]["first"]
    decoded = {split: [bytes(d[1:-1]).decode() for d in documents_of(tmp / "out", split)] for split in
               ("train", "validation")}
    for split in decoded:
        assert all(d[0] == B and d[-1] == E for d in documents_of(tmp / "out", split))
        assert manifest["splits"][split]["documents"] == len(decoded[split])
    assert sorted(decoded["train"] + decoded["validation"]) == sorted(texts)
    held = [t for t in texts if zlib.crc32(t.encode()) % 100 == 0]
    assert sorted(decoded["validation"]) == sorted(held) and held
    # The token stream, as training reads it, is the shards in the manifest's order.
    shards = TokenShards(str(tmp / "out"), manifest, "train")
    assert shards.tokens == manifest["splits"]["train"]["tokens"] == sum(len(t.encode()) + 2 for t in texts) - \
        sum(len(t.encode()) + 2 for t in held)
    assert shards.read(0, shards.tokens).tolist() == [i for d in documents_of(tmp / "out", "train") for i in d]


def test_prepare_is_deterministic_resumable_and_refuses_others(prepared, tmp_path, monkeypatch, capsys):
    src, _ = prepared
    corpus = src / "corpus"
    assert run_prepare(corpus, tmp_path / "two", "--workers", "2") == 0  # a process pool: the same bytes
    assert tree(tmp_path / "two") == tree(src / "out")
    assert "100%" in capsys.readouterr().err  # the progress bar (bytes of input, ETA) ran to the end

    real = prepare.PrepareTask._tokenize

    def failing(self, texts, tokenizer, writers):
        if writers["train"].task == 1:
            raise RuntimeError("killed")
        return real(self, texts, tokenizer, writers)

    monkeypatch.setattr(prepare.PrepareTask, "_tokenize", failing)
    with pytest.raises(RuntimeError, match="killed"):
        run_prepare(corpus, tmp_path / "cut")
    first = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cut" / "train").glob("00000-*")}
    with pytest.raises(ConfigError, match="its prepare did not finish; run the same prepare command again"):
        read_manifest(str(tmp_path / "cut"))
    monkeypatch.setattr(prepare.PrepareTask, "_tokenize", real)
    assert run_prepare(corpus, tmp_path / "cut") == 0  # resumed: task 0 is not run again
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cut" / "train").glob("00000-*")} == first
    assert tree(tmp_path / "cut") == tree(src / "out")
    assert run_prepare(corpus, tmp_path / "cut") == 0
    assert "prepared already" in capsys.readouterr().err

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    for out, extra, message in [
            (tmp_path / "busy", [], "is not empty and is not a prepare's output"),
            (tmp_path / "cut", ["--validation_every", "7"], "holds a prepare of other settings (they differ in: "
                                                            "validation_every)"),
            (tmp_path / "new", ["--input", str(tmp_path / "nothing.jsonl")], "--input: no .txt/.jsonl/.json/.parquet"),
            (tmp_path / "new", ["--tokenizer", str(tmp_path)], "--tokenizer: ")]:
        assert run_prepare(corpus, out, *extra) == 2
        assert message in capsys.readouterr().err
    assert os.listdir(tmp_path / "busy") == ["notes.txt"] and not (tmp_path / "new").exists()


def test_prepare_from_the_hub_fails_fast_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert prepare.main(["--input", "allenai/c4", "--output", str(tmp_path / "c4")]) == 2
    assert "the machine is offline (HF_HUB_OFFLINE" in capsys.readouterr().err
    assert not (tmp_path / "c4").exists()


def test_prepare_from_a_hub_stream_splits_it_over_tasks(prepared, tmp_path, monkeypatch):
    """A Hub dataset is streamed, each task taking its share (datasets' split_dataset_by_node); here the "Hub" is a
    local stream standing in for it."""
    import datasets

    src, texts = prepared
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:100]))
    local = datasets.load_dataset

    def hub(name, config=None, split=None, streaming=False):
        assert (name, config, split, streaming) == ("org/web", None, "train", True)
        return local("json", data_files=str(rows), split="train", streaming=True)

    monkeypatch.setattr(prepare, "check_hub", lambda *_: None)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert prepare.main(["--input", "org/web", "--output", str(tmp_path / "out"), "--tasks", "2", "--workers",
                         "1"]) == 0
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["sources"] == [{"hub": "org/web", "config": None, "split": "train"}]
    decoded = [bytes(d[1:-1]).decode() for split in ("train", "validation") for d in documents_of(tmp_path / "out",
                                                                                                  split)]
    assert sorted(decoded) == sorted(texts[:100])
    assert {s["file"][6:11] for s in manifest["splits"]["train"]["shards"]} == {"00000", "00001"}


def word_tokenizer(folder: Path, extra_words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(["doc", "row", "the", "text",
                                                                                  "file", "ab", "cd"])}}
    vocab.update({f"w{k}": len(vocab) + k for k in range(extra_words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    tok = word_tokenizer(tmp_path / "tok", 70_000)
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "w69999 doc w5"}) + "\n")
    assert run_prepare(tmp_path / "in.jsonl", tmp_path / "out", "--tokenizer", str(tok), "--validation_every",
                       "0") == 0
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["vocab_size"] == 70_010
    assert documents_of(tmp_path / "out", "train") == [[1, 70_009, 3, 15, 2]]
    assert build_tokenizer(str(tok)).encode("w69999 doc w5") == [70_009, 3, 15]


def test_slurm_executor_submits_an_array_then_the_manifest(prepared, tmp_path, capsys):
    """No cluster here: a stand-in sbatch records the job scripts, which then run as SLURM would run them (one
    array task at a time, then the job that writes the manifest); the result equals a local prepare's."""
    src, _ = prepared
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/sbatch.log\necho Submitted batch job 7\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    for tool in ("sbatch", "scontrol"):
        (bin_dir / tool).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tessera.data.prepare", "--input", str(src / "corpus"), "--output", str(out),
           "--piece_mb", "0.004", "--tasks", "3", "--slurm_partition", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "submitted 3 tasks to SLURM" in proc.stderr, proc.stderr[-2000:]
    script = (out / ".prepare" / "executor" / "launch_script.slurm").read_text()
    assert "#SBATCH --array=0-2" in script and "#SBATCH --partition=cpu" in script and "PYTHONPATH=" in script
    assert "--dependency=afterok:7" in (tmp_path / "sbatch.log").read_text()  # the manifest job waits for them
    for job, tasks in (("executor", 3), ("finish", 1)):
        for task in range(tasks):
            run = subprocess.run(["launch_pickled_pipeline", str(out / ".prepare" / job / "executor.pik")],
                                 env={**env, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_NODELIST": "node1"},
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, run.stderr[-2000:]
    assert tree(out) == tree(src / "out")


# --- training from prepared data ------------------------------------------------------------------------------

def loader_for(folder: Path, *extra: str, rank: int = 0, dp: int = 1, split: str = "train") -> PreparedLoader:
    cfg = parse_args(merge(["--training.dataset", "tokenized", "--training.dataset_path", str(folder),
                            "--training.seq_len", "32", "--training.local_batch_size", "4"], extra))
    return build_dataloader(cfg, ByteTokenizer(), rank, dp, split=split)


def test_order_depends_on_the_sample_index_only(prepared, monkeypatch):
    """Global sample i is the same window whatever the DP degree; an epoch visits every window once; a resume at
    any position continues without replaying anything, and a rank reads only the bytes of its own samples."""
    out = prepared[0] / "out"
    expected = loader_for(out).samples(np.arange(64))
    monkeypatch.setattr(tokens, "OPEN_SHARDS", 1)  # shards are unmapped and mapped again as reads move on
    assert np.array_equal(loader_for(out).samples(np.arange(64)), expected)
    steps, global_batch = 6, 8
    reference = None
    for dp in (1, 2, 4, 8):
        loaders = [loader_for(out, "--training.local_batch_size", str(global_batch // dp), rank=r, dp=dp)
                   for r in range(dp)]
        per_rank = [[lo.next_batch()[0] for _ in range(steps)] for lo in loaders]
        merged = [torch.stack([per_rank[r][s] for r in range(dp)], 1).flatten(0, 1) for s in range(steps)]
        reference = merged if reference is None else reference
        assert all(torch.equal(a, b) for a, b in zip(merged, reference, strict=True)), f"DP {dp}"
        assert all(lo.bytes_read == steps * (global_batch // dp) * 33 * 2 for lo in loaders)
    whole = loader_for(out)
    n = whole.windows[0]
    assert sorted(whole.locate(np.arange(n))[1].tolist()) == list(range(n))  # epoch 0: each window once
    assert not np.array_equal(whole.locate(np.arange(n))[1], whole.locate(np.arange(n, 2 * n))[1])  # reshuffled
    assert not np.array_equal(whole.locate(np.arange(n))[1], loader_for(out, "--training.seed", "1").locate(
        np.arange(n))[1])
    far = loader_for(out)
    far.load_state_dict({"sample_index": 10 ** 15, "prepared": far.identity})
    got = far.next_batch()[0]
    assert torch.equal(got, torch.from_numpy(whole.samples(10 ** 15 + np.arange(4))[:, :-1].astype(np.int64)))
    assert far.bytes_read == 4 * 33 * 2
    for n in (1, 2, 5, 4096, 10 ** 6 + 3):
        assert sorted(permute(np.arange(n), n, 99).tolist()) == list(range(n))
    val = loader_for(out, split="validation")  # held out, read in order, the same at each evaluation
    first = val.next_batch()[0]
    val.rewind()
    assert torch.equal(val.next_batch()[0], first) and first[0, 0] == B


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix")
    for name in ("web", "code", "math"):
        write_corpus(tmp / "corpora" / name, n=60 if name == "math" else 200, tag=name)
        assert run_prepare(tmp / "corpora" / name, tmp / "data" / name) == 0
    return tmp


def test_mixture_proportions_and_resume(mixture):
    data = mixture / "data"
    loader = loader_for(data, "--training.dataset_mix", "web:0.7,code:0.2,math:0.1", "--training.local_batch_size",
                        "10")
    which, _ = loader.locate(np.arange(10_000))
    counts = np.bincount(which, minlength=3) / 10_000
    assert np.abs(counts - [0.7, 0.2, 0.1]).max() < 0.01
    assert all(abs(got - want) <= 1 / BLOCK for got, want in zip(loader.mixture.counts / BLOCK, (0.7, 0.2, 0.1),
                                                                  strict=True))
    for n in range(0, 10_001):  # the closed form counts what was dealt, and any prefix holds its share
        taken = loader.mixture.taken(n)
        assert np.abs(taken - loader.mixture.counts * n / BLOCK).max() < 1
    assert all(list(loader.mixture.taken(n)) == list(np.bincount(which[:n], minlength=3)) for n in (1, 4097, 10_000))
    for _ in range(1000):
        loader.next_batch()
    assert loader.shares() == pytest.approx({"web": counts[0], "code": counts[1], "math": counts[2]})
    text = bytes(i for i in loader.samples(np.arange(300)).flatten().tolist() if i < 256)
    assert all(name.encode() in text for name in ("web", "code", "math"))
    # Resumed on 2 ranks at sample 90, the mixture continues as one rank would have.
    ranks = [loader_for(data, "--training.dataset_mix", "web:0.7,code:0.2,math:0.1", rank=r, dp=2) for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(loader.state_dict() | {"sample_index": 90})
    got = torch.stack([r.next_batch()[0] for r in ranks], 1).flatten(0, 1)
    assert torch.equal(got, torch.from_numpy(loader.samples(90 + np.arange(8))[:, :-1].astype(np.int64)))
    other = loader_for(data, "--training.dataset_mix", "web:0.5,code:0.5")
    with pytest.raises(ConfigError, match="add dataloader to checkpoint.exclude_from_loading"):
        other.load_state_dict(loader.state_dict())
    with pytest.raises(ConfigError, match="not of this run's"):
        other.load_state_dict({"sample_index": 8, "streams": 64})
    # The trainer logs the realized shares with its metrics (8 samples a step).
    last = run_local(mixture / "run", "--training.dataset", "tokenized", "--training.dataset_path", str(data),
                     "--training.dataset_mix", "web:0.7,code:0.2,math:0.1", "--training.steps", "3")[-1]
    assert {k: v for k, v in last.items() if k.startswith("mix/")} == \
        pytest.approx({f"mix/{k}": v for k, v in loader.shares(24).items()})
    toml = mixture / "mix.toml"
    toml.write_text('[training]\ndataset = "tokenized"\n[training.dataset_mix]\nweb = 0.7\ncode = 0.2\nmath = 0.1\n')
    assert parse_args(["--job.config_file", str(toml)]).training.dataset_mix == "web:0.7,code:0.2,math:0.1"


def check(*argv: str) -> None:
    validate(parse_args(merge(["--model.flavor", "tiny", "--training.seq_len", "32"], argv)), 1)


def test_bad_prepared_data_is_one_line_before_training(prepared, mixture, tmp_path):
    src, _ = prepared
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(src / "out"), str(copy)], check=True)
    tok = word_tokenizer(tmp_path / "tok", 10)
    shard = read_manifest(str(copy))["splits"]["train"]["shards"][1]["file"]
    data = ["--training.dataset", "tokenized", "--training.dataset_path"]
    check(*data, str(copy))
    check("--training.dataset", "files", "--training.dataset_path", str(copy))  # a prepared folder is detected
    cases = [
        ([*data, str(src / "corpus")], "is not a prepared dataset (no manifest.json); prepare it with"),
        ([*data, str(copy), "--model.hf_assets_path", str(tok)], "was prepared with the built-in byte tokenizer, but "
                                                                 "this run tokenizes with tokenizer.json"),
        ([*data, str(copy), "--training.seq_len", "10000"], "the train split of"),
        (["--training.dataset", "tokenized"], "training.dataset_path: empty"),
        (["--training.dataset_mix", "web:0.7"], "training.dataset_mix: mixes prepared datasets, but training.dataset"),
        ([*data, str(mixture / "data"), "--training.dataset_mix", "web:0.7,code"], "'code' is not NAME:WEIGHT"),
        ([*data, str(mixture / "data"), "--training.dataset_mix", "web:0.7,code:-1"], "weights must be positive"),
        ([*data, str(mixture / "data"), "--training.dataset_mix", "web:1,art:1"], "training.dataset_mix: no folder"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=None) as err:
            check(*argv)
        assert message in str(err.value), (argv, str(err.value))
    os.truncate(copy / shard, 100)
    with pytest.raises(ConfigError, match=f"shard {copy / shard} is truncated: 100 bytes, the manifest says"):
        check(*data, str(copy))
    os.remove(copy / shard)
    with pytest.raises(ConfigError, match=f"shard {copy / shard} is missing"):
        check(*data, str(copy))
    # Through the launcher's entry point: exit status 2, the one line, nothing written.
    proc = subprocess.run([sys.executable, "-m", "tessera.train", "--model.flavor", "tiny", "--training.seq_len",
                           "32", *data, str(copy), "--job.dump_folder", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stderr.strip().startswith("tessera: training.dataset_path: shard")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.ranks
def test_resume_across_a_dp_change_and_document_masking_under_cp(prepared, tmp_path):
    """A 1-rank run resumed from its step-4 checkpoint on 2 ranks reproduces its losses, samples and weights (its
    data_streams changed: prepared data is not dealt to streams); and
    block-causal attention (documents packed into each window) under CP 2 equals one process."""
    out = str(prepared[0] / "out")
    data = ["--training.dataset", "tokenized", "--training.dataset_path", out, "--training.local_batch_size", "8"]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]
    full = run_train([*data, "--job.dump_folder", str(tmp_path / "full"), *ckpt], 8)
    masked = run_train([*data, "--model.attn_mask_type", "block_causal"], 8)
    causal = run_train(data, 8)
    resumed, cp2 = run_cases(2, [
        [*data, "--training.local_batch_size", "4", "--job.dump_folder",
         str(resume_copy(tmp_path / "full", tmp_path / "dp2", 4)), *ckpt, "--training.data_streams", "8"],
        [*data, "--model.attn_mask_type", "block_causal", "--parallelism.context_parallel_degree", "2"]],
        8, mode="train")
    assert resumed["start"] == 4
    for s in range(5, 9):
        assert abs(resumed["losses"][s] - full["losses"][s]) < 1e-5
        assert sorted(resumed["samples"][s]) == sorted(full["samples"][s])
    for name, value in resumed["params"].items():
        torch.testing.assert_close(value, full["params"][name], rtol=1e-5, atol=1e-5)
    wq = "layers.0.attention.wq.weight"  # documents are packed several to a window: the mask matters
    assert (masked["params"][wq] - causal["params"][wq]).abs().max() > 0.1 * causal["params"][wq].abs().max()
    for s in range(1, 9):
        assert abs(cp2["losses"][s] - masked["losses"][s]) < 1e-5
    for name, value in cp2["params"].items():
        torch.testing.assert_close(value, masked["params"][name], rtol=1e-5, atol=1e-5)
