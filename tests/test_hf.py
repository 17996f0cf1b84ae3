"""Hugging Face interop: safetensors in and out (one process and FSDP-sharded), the convert CLI, the download script.

Run as a script under torchrun, this file is the 2-rank worker of `test_fsdp_save_and_load_hf`.
"""

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tessera.checkpoint.hf import HFError, load_hf, save_hf
from tessera.models.llama3.args import FLAVORS
from tessera.models.llama3.hf import hf_config
from tessera.models.llama3.model import Transformer
from tessera.parallel.init import materialize

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TOKENS = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
CASES = {"gqa": {}, "tied": dict(tie_embeddings=True), "mha": dict(n_kv_heads=4),
         "rope_llama3": dict(rope_original_max_pos=16, rope_scaling_factor=4.0),
         "no_rope_scaling": dict(rope_scaling_factor=0.0)}


def _args(**kw):
    return dataclasses.replace(FLAVORS["tiny"], **{"vocab_size": 97, "max_seq_len": 32, **kw})


def _ours(args, seed: int | None = 0) -> Transformer:
    """Materialized from `seed`; seed None: uninitialized (garbage) weights, for loading into."""
    with torch.device("meta"):
        model = Transformer(args)
    if seed is None:
        model.to_empty(device="cpu")
        model.init_buffers(torch.device("cpu"))
    else:
        materialize(model, torch.device("cpu"), seed)
    return model.eval()


def _theirs(args, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(args).items() if k != "rope_scaling"})
    config.rope_parameters = hf_config(args)["rope_parameters"]
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def _pretrained(path):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def _assert_same_logits(ours, theirs):
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), theirs(TOKENS).logits, rtol=1e-5, atol=1e-5)


# --- HF -> ours ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_load_hf_from_transformers(case, tmp_path):
    args = _args(**CASES[case])
    theirs = _theirs(args)
    theirs.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    ours = _ours(args, seed=None)
    load_hf(ours, tmp_path)
    _assert_same_logits(ours, theirs)


def test_load_hf_sharded_with_index(tmp_path):
    args = _args()
    theirs = _theirs(args)
    theirs.save_pretrained(tmp_path, max_shard_size="40KB")
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    ours = _ours(args, seed=None)
    load_hf(ours, tmp_path)
    _assert_same_logits(ours, theirs)


# --- ours -> HF ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["gqa", "tied", "rope_llama3"])
def test_save_hf_loads_in_transformers(case, tmp_path):
    args = _args(**CASES[case])
    ours = _ours(args)
    save_hf(ours.state_dict(), args, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                          "model.safetensors.index.json"]
    _assert_same_logits(ours, _pretrained(tmp_path))


def test_save_hf_sharded_and_bf16_round_trip(tmp_path):
    args = _args()
    ours = _ours(args)
    save_hf(ours, args, tmp_path, dtype=torch.bfloat16, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and files == {p.name for p in tmp_path.glob("*.safetensors")}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _pretrained(tmp_path).model.embed_tokens.weight.dtype == torch.bfloat16
    back = _ours(args, seed=None)
    load_hf(back, tmp_path)
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value.bfloat16().float(), rtol=0, atol=0)
    # An export with fewer files replaces the earlier one completely.
    save_hf(ours, args, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]


# --- bad input ----------------------------------------------------------------------------------------------


def test_load_hf_errors_name_the_problem(tmp_path, caplog):
    args = _args()
    with pytest.raises(HFError, match="no such file or folder .*nowhere"):
        load_hf(_ours(args, seed=None), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFError, match=r"no \*\.safetensors files in .*empty"):
        load_hf(_ours(args, seed=None), tmp_path / "empty")

    save_hf(_ours(args).state_dict(), args, tmp_path / "v97")
    with pytest.raises(HFError) as e:
        load_hf(_ours(_args(vocab_size=100), seed=None), tmp_path / "v97")
    assert str(e.value) == (f"shape mismatch for 'model.embed_tokens.weight' in '{tmp_path / 'v97'}': "
                            f"checkpoint [97, 64], model [100, 64]")

    state = _ours(args).state_dict()
    del state["norm.weight"]
    save_hf(state, args, tmp_path / "no_norm")
    with pytest.raises(HFError, match=r"missing tensor 'model\.norm\.weight' \(for norm\.weight\)"):
        load_hf(_ours(args, seed=None), tmp_path / "no_norm")

    save_hf(_ours(_args(n_layers=3)).state_dict(), _args(n_layers=3), tmp_path / "three")
    with pytest.raises(HFError, match=r"unexpected tensor 'model\.layers\.2\.[a-z_.]+\.weight'"):
        load_hf(_ours(args, seed=None), tmp_path / "three")
    # A pipeline stage holding layers 0-1 takes what it has.
    load_hf(_ours(args, seed=None), tmp_path / "three", strict=False)

    # Settings that shapes cannot show are compared with config.json: a warning names each difference.
    config = json.loads((tmp_path / "v97" / "config.json").read_text())
    (tmp_path / "v97" / "config.json").write_text(json.dumps({**config, "rope_theta": 1e4, "rms_norm_eps": 1e-6,
                                                               "rope_parameters": {"rope_type": "default"}}))
    caplog.clear()
    with caplog.at_level("WARNING", logger="tessera.checkpoint.hf"):
        load_hf(_ours(args, seed=None), tmp_path / "v97")
    assert [r.getMessage() for r in caplog.records if r.name == "tessera.checkpoint.hf"] == [
        f"{tmp_path / 'v97' / 'config.json'}: {d}; the weights load, but the model may compute differently"
        for d in ("rms_norm_eps=1e-06 (ours 1e-05)", "rope rope_type='default' (ours 'llama3')",
                  "rope rope_theta=10000.0 (ours 500000.0)")]

    from safetensors.torch import save_file
    (tmp_path / "odd").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(97, 64), "vision_tower.proj": torch.zeros(2)},
              str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(HFError, match="unexpected tensor 'vision_tower.proj'"):
        load_hf(_ours(args, seed=None), tmp_path / "odd")


# --- convert CLI --------------------------------------------------------------------------------------------


def _tessera_checkpoint(path: Path, ours: Transformer) -> None:
    """What the trainer writes: nested model / optimizer / train state, config.toml and the .complete marker."""
    import torch.distributed.checkpoint as dcp

    from tessera.checkpoint.manager import write_marker
    from tessera.config import parse_args, to_toml

    state = {"model": ours.state_dict(), "optimizer": {"state": {"norm.weight": {"exp_avg": torch.ones(64)}}},
             "train": {"step": 3}}
    with warnings.catch_warnings():  # "... assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    cfg = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32"])
    (path / "config.toml").write_text(to_toml(cfg))
    write_marker(str(path), 3, "full")


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_convert_cli_round_trip(tmp_path):
    ours = _ours(_args())
    ckpt, hf, back, pt = tmp_path / "step-3", tmp_path / "hf", tmp_path / "step-0", tmp_path / "model.pt"
    _tessera_checkpoint(ckpt, ours)
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
    assert config["vocab_size"] == 97 and config["max_position_embeddings"] == 32  # from the checkpoint
    _assert_same_logits(ours, _pretrained(hf))
    # hf-to-dcp found the flavor from config.json and wrote a model-only Tessera checkpoint.
    assert "flavor = \"tiny\"" in (back / "config.toml").read_text()
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
    assert "shape mismatch for 'model.tok_embeddings.weight'" in msg and "debugmodel" in msg
    assert "unknown llama3 flavor 'huge'" in error("dcp-to-hf", str(ckpt), str(tmp_path / "o"), "--model.flavor=huge")
    hf = tmp_path / "hf"
    save_hf(_ours(_args(dim=32, n_heads=2, n_kv_heads=1)).state_dict(), _args(dim=32, n_heads=2, n_kv_heads=1), hf)
    assert "no llama3 flavor matches" in error("hf-to-dcp", str(hf), str(tmp_path / "o"))


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


# --- 2 ranks: FSDP-sharded save and load --------------------------------------------------------------------


def test_fsdp_save_and_load_hf(tmp_path):
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tests.test_hf", str(tmp_path)]
    proc = _run(*cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert not (tmp_path / "hf" / "sharded").exists()
    ours = _ours(_args(), seed=0)
    _assert_same_logits(ours, _pretrained(tmp_path / "hf"))
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)  # FSDP model (seed 1) after load_hf, gathered
    assert loaded.keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)


def _fsdp_worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tessera.distributed import shutdown
    from tessera.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))

    def sharded(seed):
        with torch.device("meta"):
            model = Transformer(_args())
        apply_fsdp(model, mesh, list(model.layers.values()), param_dtype=torch.float32, reduce_dtype=torch.float32)
        materialize(model, torch.device("cpu"), seed)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        return model

    save_hf(sharded(0), _args(), out / "hf")
    model = sharded(1)
    load_hf(model, out / "hf")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, out / "loaded.pt")
    shutdown(clean=True)


if __name__ == "__main__":
    _fsdp_worker(Path(sys.argv[1]))


# --- through the trainer: start from HF weights, finish with an HF export ---------------------------------------


def test_trainer_imports_and_exports_hf(tmp_path):
    from tests.launch import run_local

    args = _args(vocab_size=258)  # the byte tokenizer's vocabulary, which the trainer's "tiny" takes
    theirs = _theirs(args, seed=3)
    theirs.save_pretrained(tmp_path / "hf_in")
    # lr 0: the step leaves the weights as imported, so the export must equal the HF model exactly.
    run_local(tmp_path / "run", "--training.steps", "1", "--optimizer.lr", "0", "--checkpoint.enable",
              "--checkpoint.initial_load_path", str(tmp_path / "hf_in"), "--checkpoint.initial_load_in_hf",
              "--checkpoint.last_save_in_hf")
    out = tmp_path / "run/checkpoint/step-1"
    assert (out / ".complete").exists() and (out / "config.json").exists()
    exported = _pretrained(out)
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, rtol=0, atol=0)
