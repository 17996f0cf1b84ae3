"""Hugging Face in whole workflows: the convert CLI, the download script, and the trainer starting from HF
weights and finishing with an HF export (1 process, PP 2, TP 2), or refusing a model that is not the HF one."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tessera.checkpoint.hf import save_hf
from tessera.models.common.decoder import Decoder as Transformer
from tests.test_hf import ENV, ROOT, _args, _assert_same_logits, _hf_folder, _ours, _pretrained, _run

# --- convert CLI --------------------------------------------------------------------------------------------


def _tessera_checkpoint(path: Path, ours: Transformer, assets: Path | None = None) -> None:
    """What the trainer writes: nested model / optimizer / train state, config.toml and the .complete marker;
    `assets`: the run's tokenizer folder (model.hf_assets_path)."""
    import torch.distributed.checkpoint as dcp

    from tessera.checkpoint.manager import write_marker
    from tessera.config import to_toml
    from tessera.schema import parse_args

    state = {"model": ours.state_dict(), "optimizer": {"state": {"norm.weight": {"exp_avg": torch.ones(64)}}},
             "train": {"step": 3}}
    with warnings.catch_warnings():  # "... assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    cfg = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32",
                      *(["--model.hf_assets_path", str(assets)] if assets else [])])
    (path / "config.toml").write_text(to_toml(cfg))
    write_marker(str(path), 3, "full")


def test_convert_cli_round_trip(tmp_path):
    ours = _ours(_args())
    ckpt, hf, back, pt = tmp_path / "step-3", tmp_path / "hf", tmp_path / "step-0", tmp_path / "model.pt"
    assets = tmp_path / "tokenizer"
    assets.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md"):
        (assets / name).write_text(f"{name} of the run")
    _tessera_checkpoint(ckpt, ours, assets)
    # One interpreter runs `python -m tessera.convert ...` three times, then torch's own converter on our
    # checkpoint: start-up dominates.
    runs = [["tessera.convert", "dcp-to-hf", str(ckpt), str(hf)], ["tessera.convert", "hf-to-dcp", str(hf), str(back)],
            ["tessera.convert", "dcp-to-torch", str(back), str(pt)],
            ["torch.distributed.checkpoint.format_utils", "dcp_to_torch", str(ckpt), str(tmp_path / "t.pt")]]
    script = ("import json, runpy, sys\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    sys.argv = argv\n"
              "    try:\n        runpy.run_module(argv[0], run_name='__main__', alter_sys=True)\n"
              "    except SystemExit as e:\n        assert not e.code, (argv, e.code)\n")
    proc = _run("-c", script, json.dumps(runs))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    config = json.loads((hf / "config.json").read_text())
    assert config["vocab_size"] == 97  # the checkpoint's, which "tiny" takes from the tokenizer
    assert config["max_position_embeddings"] > config["rope_parameters"]["original_max_position_embeddings"]
    _assert_same_logits(ours, _pretrained(hf))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the run's tokenizer, which the export loads with
        assert (hf / name).read_text() == f"{name} of the run"
    assert not (hf / "README.md").exists()
    # hf-to-dcp built config.json's architecture and wrote a model-only Tessera checkpoint recording it.
    from tessera.models import args_from_json
    assert args_from_json(json.loads((back / "model.json").read_text()))[1].arch() == _args().arch()
    from tessera.checkpoint.manager import read_marker, verify
    marker = read_marker(str(back))
    assert marker["kind"] == "model" and marker["step"] == 0 and "config.toml" in marker["files"]
    verify(str(back), marker)
    saved = torch.load(pt, weights_only=True)
    assert saved.keys() == {"model"} and saved["model"].keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(saved["model"][name], value, rtol=0, atol=0)
    # torch's own converter read our checkpoint too.
    full = torch.load(tmp_path / "t.pt", weights_only=True)
    torch.testing.assert_close(full["model"]["layers.1.attention.wk.weight"],
                               ours.state_dict()["layers.1.attention.wk.weight"], rtol=0, atol=0)
    assert full["train"]["step"] == 3


def test_convert_cli_bad_input(tmp_path, capsys):
    from tessera.convert import main

    def error(*argv) -> str:
        with pytest.raises(SystemExit) as e:
            main([*argv])
        assert e.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "no such file or folder" in error("dcp-to-hf", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert "is not a DCP checkpoint (no .metadata)" in error("dcp-to-hf", str(tmp_path), str(tmp_path / "out"))
    assert "no *.safetensors files" in error("hf-to-dcp", str(tmp_path), str(tmp_path / "o"), "--model.flavor", "tiny")
    ckpt = tmp_path / "step-1"
    _tessera_checkpoint(ckpt, _ours(_args()))
    msg = error("dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--model.flavor", "debugmodel")
    assert "written by flavor 'tiny', not 'debugmodel'" in msg
    assert "'huge' is not a llama3 flavor" in error("dcp-to-hf", str(ckpt), str(tmp_path / "o"), "--model.flavor=huge")
    hf = tmp_path / "hf"
    save_hf(_ours(_args(dim=32, n_heads=2, n_kv_heads=1)).state_dict(), _args(dim=32, n_heads=2, n_kv_heads=1), hf)
    msg = error("hf-to-dcp", str(hf), str(tmp_path / "o"), "--model.flavor", "tiny")
    assert "'tiny' and" in msg and "differ in 4 field(s): dim: 32 (config.json) vs 64 (flavor)" in msg
    assert not (tmp_path / "o").exists()
    # Destinations: one line before any work, nothing replaced unless --overwrite, which replaces the folder whole.
    afile, other = tmp_path / "afile", tmp_path / "other-export"
    afile.write_text("x")
    assert "is a file; dcp-to-hf writes a folder" in error("dcp-to-hf", str(ckpt), str(afile))
    assert "is a file, so" in error("hf-to-dcp", str(hf), str(afile / "step-0"))
    assert "is a folder; dcp-to-torch writes one file" in error("dcp-to-torch", str(ckpt), str(tmp_path))
    assert "already exists; give a new or empty file" in error("dcp-to-torch", str(ckpt), str(afile))
    assert afile.read_text() == "x"
    small = _args(dim=32, n_heads=2, n_kv_heads=1)
    save_hf(_ours(small).state_dict(), small, other)  # another run's export, with its marker
    (other / ".complete").write_text("{}")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert "already exists and is not empty" in error("dcp-to-hf", str(ckpt), str(other))
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert "holds the source" in error("dcp-to-hf", str(ckpt), str(tmp_path), "--overwrite")
    assert main(["dcp-to-hf", str(ckpt), str(other), "--overwrite"]) == 0
    assert not (other / ".complete").exists() and (other / "config.json").read_bytes() != before["config.json"]
    assert [p.name for p in tmp_path.iterdir() if ".converting-" in p.name] == []
    # A run whose tokenizer folder is not on this machine converts, its export without the tokenizer, in one line.
    moved = tmp_path / "step-2"
    _tessera_checkpoint(moved, _ours(_args()), tmp_path / "gone")
    assert main(["dcp-to-hf", str(moved), str(tmp_path / "bare")]) == 0
    assert capsys.readouterr().err == (f"python -m tessera.convert: warning: model.hf_assets_path: the run's tokenizer "
                                       f"folder '{tmp_path / 'gone'}' (its config.toml) is not here; the export "
                                       f"carries no tokenizer files\n")
    assert (tmp_path / "bare/config.json").exists() and not (tmp_path / "bare/tokenizer.json").exists()


# --- download script ----------------------------------------------------------------------------------------


def test_download_patterns():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from download_hf_assets import patterns
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert patterns(["tokenizer"]) == ["tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                       "special_tokens_map.json"]
    assert patterns(["config"]) == ["config.json", "generation_config.json"]
    assert patterns(["safetensors"]) == ["*.safetensors", "model.safetensors.index.json"]
    assert patterns(["config", "tokenizer", "config"]) == ["config.json", "generation_config.json",
                                                           *patterns(["tokenizer"])]
    with pytest.raises(ValueError, match="unknown asset 'weights'"):
        patterns(["weights"])


def test_download_offline_is_one_clear_line(tmp_path):
    env = {**ENV, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home"), "HF_TOKEN": "hf_secret_do_not_print"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "download_hf_assets.py"), "--repo_id", "org/missing",
                           "--assets", "tokenizer", "config", "--local_dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("download_hf_assets: error: cannot reach the Hugging Face Hub for 'org/missing' "
                                   "(offline, or HF_HUB_OFFLINE=1) and no cached copy")
    assert "hf_secret" not in proc.stdout + proc.stderr


# --- through the trainer: start from HF weights, finish with an HF export ---------------------------------------


def _odd_hf_model(path: Path, seed: int = 3, **overrides):
    """A transformers Llama no flavor matches (6/2 heads of 12, ffn 100, attention biases), on the byte
    tokenizer's vocabulary."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{**dict(hidden_size=72, num_hidden_layers=4, num_attention_heads=6,
                                                num_key_value_heads=2, intermediate_size=100, vocab_size=258,
                                                rms_norm_eps=1e-5, max_position_embeddings=64,
                                                attention_bias=True), **overrides})
    torch.manual_seed(seed)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    theirs.save_pretrained(path)
    return theirs


HF_RUN = ["--model.flavor=", "--training.steps", "1", "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "0",
          "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf"]


def _assert_exported(theirs, dump: Path) -> None:
    out = dump / "checkpoint/exports/step-1"
    assert (out / ".complete").exists() and (out / "config.json").exists()
    exported = _pretrained(out)
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, rtol=0, atol=0)
    assert (exported.generation_config.bos_token_id, exported.generation_config.eos_token_id) == (256, 257)
    record = json.loads((dump / "checkpoint/step-1/model.json").read_text())  # resume rebuilds exactly this
    assert record["args"]["dim"] == 72 and record["args"]["ffn_hidden_override"] == 100


@pytest.mark.ranks
def test_trainer_imports_and_exports_hf(tmp_path):
    """With model.flavor empty the run builds config.json's model, whatever it is; lr 0 leaves the weights as
    imported, so the export equals the HF model exactly. One process, then 2 pipeline stages, then TP 2."""
    from tests.launch import run_dist, run_local

    theirs = _odd_hf_model(tmp_path / "hf_in")
    load = ["--checkpoint.initial_load_path", str(tmp_path / "hf_in")]
    run_local(tmp_path / "run", *HF_RUN, *load)
    _assert_exported(theirs, tmp_path / "run")
    for name, degree in (("pp", "pipeline_parallel_degree"), ("tp", "tensor_parallel_degree")):
        run_dist(2, tmp_path / name, *HF_RUN, *load, f"--parallelism.{degree}", "2", "--training.local_batch_size", "4")
        _assert_exported(theirs, tmp_path / name)


def test_trainer_refuses_a_model_that_is_not_the_hf_one(tmp_path, capsys):
    """The measured silent cases, refused before training in one line, nothing written: tiny's shapes with HF's
    default RoPE and eps; 8/4 heads of 8 dims as tiny's 4/2 of 16; a tokenizer with ids past the vocabulary.
    (An untied lm_head into tied embeddings: test_load_hf_errors_name_the_problem.)"""
    from tessera.train import main
    from tests.launch import TINY, merge

    tiny = _args(vocab_size=258)
    edits = {"rope": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "rope_scaling": None,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
             "heads": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}}
    expected = {"rope": "differs in 3 field(s): norm_eps: 1e-06 (config.json) vs 1e-05 (flavor); rope_theta: 10000.0",
                "heads": "differs in 3 field(s): n_heads: 8 (config.json) vs 4 (flavor); n_kv_heads: 4",
                "vocab": "the tokenizer has 258 tokens, more than the model's vocabulary (200)"}
    for case, want in expected.items():
        folder = _hf_folder(tmp_path / case, _args(vocab_size=200) if case == "vocab" else tiny, **edits.get(case, {}))
        dump = tmp_path / f"run_{case}"
        flavor = "--model.flavor=" if case == "vocab" else "--model.flavor=tiny"
        assert main(merge(TINY, HF_RUN, ["--job.dump_folder", str(dump), "--checkpoint.initial_load_path",
                                         str(folder), flavor])) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], (case, err)
        assert not dump.exists()
