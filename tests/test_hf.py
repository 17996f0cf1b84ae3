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


def _hf_folder(path: Path, args, **config) -> Path:
    """Our model from seed 0 saved as HF, its config.json then edited by `config`."""
    save_hf(_ours(args).state_dict(), args, path)
    if config:
        (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **config}))
    return path


def test_load_hf_errors_name_the_problem(tmp_path):
    args = _args()
    with pytest.raises(HFError, match="no such file or folder .*nowhere"):
        load_hf(_ours(args, seed=None), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFError, match=r"no \*\.safetensors files in .*empty"):
        load_hf(_ours(args, seed=None), tmp_path / "empty")

    # config.json is compared with the model built, field by field, before any tensor is read.
    v97 = _hf_folder(tmp_path / "v97", args)
    with pytest.raises(HFError) as e:
        load_hf(_ours(_args(vocab_size=100), seed=None), v97)
    assert str(e.value) == (f"{v97 / 'config.json'} describes another model than the one built, in 1 field(s): "
                            f"vocab_size: 97 (config.json) vs 100 (model); build config.json's architecture "
                            f"(leave model.flavor empty)")
    # Settings that shapes cannot show: HF's default RoPE theta, no scaling, its eps.
    _hf_folder(tmp_path / "rope", args, rope_theta=1e4, rms_norm_eps=1e-6, rope_scaling=None,
               rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(HFError, match=r"in 3 field\(s\): norm_eps: 1e-06 \(config.json\) vs 1e-05 \(model\); "
                                      r"rope_theta: 10000.0 \(config.json\) vs 500000.0 \(model\); "
                                      r"rope_scaling_factor: 0.0 \(config.json\) vs 8.0 \(model\)"):
        load_hf(_ours(args, seed=None), tmp_path / "rope")
    # 8/4 heads of 8 dims have the shapes of 4/2 heads of 16.
    _hf_folder(tmp_path / "heads", args, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    with pytest.raises(HFError, match=r"n_heads: 8 \(config.json\) vs 4 \(model\); n_kv_heads: 4 \(config.json\) "
                                      r"vs 2 \(model\); head_dim: 8 \(config.json\) vs 16 \(model\)"):
        load_hf(_ours(args, seed=None), tmp_path / "heads")
    # Tensors: each one checked against the whole model the config describes.
    _hf_folder(tmp_path / "shape", args, vocab_size=100)
    with pytest.raises(HFError, match=r"shape mismatch for 'model.embed_tokens.weight' in .*: checkpoint \[97, 64\], "
                                      r"model \[100, 64\]"):
        load_hf(_ours(_args(vocab_size=100), seed=None), tmp_path / "shape")
    state = _ours(args).state_dict()
    del state["norm.weight"]
    save_hf(state, args, tmp_path / "no_norm")
    with pytest.raises(HFError, match=r"missing tensor 'model\.norm\.weight' \(for norm\.weight\)"):
        load_hf(_ours(args, seed=None), tmp_path / "no_norm")
    _hf_folder(tmp_path / "three", _args(n_layers=3), num_hidden_layers=2)
    with pytest.raises(HFError, match=r"unexpected tensor 'model\.layers\.2\.[a-z_.]+\.weight' in .*: the model built "
                                      r"has no layers\.2\."):
        load_hf(_ours(args, seed=None), tmp_path / "three")
    # An untied lm_head is never dropped into tied embeddings: by config.json, and by the tensor itself.
    untied = _hf_folder(tmp_path / "untied", args)
    with pytest.raises(HFError, match=r"tie_embeddings: False \(config.json\) vs True \(model\)"):
        load_hf(_ours(_args(tie_embeddings=True), seed=None), untied)
    _hf_folder(tmp_path / "lies", args, tie_word_embeddings=True)
    with pytest.raises(HFError, match="unexpected tensor 'lm_head.weight' in .*: the model built has no output.weight"):
        load_hf(_ours(_args(tie_embeddings=True), seed=None), tmp_path / "lies")

    from safetensors.torch import save_file
    (tmp_path / "odd").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(97, 64), "vision_tower.proj": torch.zeros(2)},
              str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(HFError, match="no config.json in .*odd.*: the weights' architecture is unknown"):
        load_hf(_ours(args, seed=None), tmp_path / "odd")
    (tmp_path / "odd" / "config.json").write_text(json.dumps(hf_config(args)))
    with pytest.raises(HFError, match="unexpected tensor 'vision_tower.proj'"):
        load_hf(_ours(args, seed=None), tmp_path / "odd")
    (tmp_path / "odd" / "config.json").write_text(json.dumps({**hf_config(args), "mlp_bias": True}))
    with pytest.raises(HFError, match=r"config.json: mlp_bias = True: Tessera's llama3 computes .*mlp_bias = False"):
        load_hf(_ours(args, seed=None), tmp_path / "odd")


# --- any valid Llama config.json, none of them a preset flavor: built from config.json, exact both ways ---------

ODD = {  # transformers' own LlamaConfig fields
    "odd_heads": dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=3, intermediate_size=100),
    "mqa": dict(num_attention_heads=8, num_key_value_heads=1, intermediate_size=96),
    "untied_odd_vocab": dict(vocab_size=1001, tie_word_embeddings=False),
    "tied_head_dim_apart": dict(head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "attention_bias": dict(attention_bias=True, num_key_value_heads=4),
    "rope_llama3_long": dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e4, factor=4.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=16),
                             max_position_embeddings=64),
}


@pytest.mark.parametrize("case", ODD)
def test_any_llama_config_builds_and_round_trips(case, tmp_path):
    from tessera.models import hf_args

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, intermediate_size=128, vocab_size=97,
                                                max_position_embeddings=256), **ODD[case]})
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF starts biases at 0: make them count
        for name, p in theirs.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    theirs.save_pretrained(tmp_path / "in")
    seq = 128 if case.startswith("rope") else 32  # 8x the original context: the scaled frequencies matter
    tokens = torch.randint(0, 97, (2, seq), generator=torch.Generator().manual_seed(1))
    args = dataclasses.replace(hf_args("llama3", str(tmp_path / "in")), max_seq_len=seq)
    assert all(args.arch() != f.arch() for f in FLAVORS.values())
    ours = _ours(args, seed=None)
    load_hf(ours, tmp_path / "in")
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
        save_hf(ours, args, tmp_path / "out", bos_id=1, eos_id=2)
        back = _pretrained(tmp_path / "out")
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    assert back.generation_config.bos_token_id == 1 and back.generation_config.eos_token_id == 2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 2


def test_exported_config_is_one_transformers_accepts_silently():
    """Every flavor's config.json loads in transformers without a warning (RoPE scaling and context agree)."""
    import logging

    transformers = pytest.importorskip("transformers")
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        for name, args in FLAVORS.items():
            transformers.LlamaConfig(**hf_config(dataclasses.replace(args, max_seq_len=2048), 1, 2))
            assert not warned, (name, [r.getMessage() for r in warned])
    finally:
        logging.getLogger("transformers").removeHandler(handler)


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
    assert config["vocab_size"] == 97  # the checkpoint's, which "tiny" takes from the tokenizer
    assert config["max_position_embeddings"] > config["rope_parameters"]["original_max_position_embeddings"]
    _assert_same_logits(ours, _pretrained(hf))
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
    assert "unknown llama3 flavor 'huge'" in error("dcp-to-hf", str(ckpt), str(tmp_path / "o"), "--model.flavor=huge")
    hf = tmp_path / "hf"
    save_hf(_ours(_args(dim=32, n_heads=2, n_kv_heads=1)).state_dict(), _args(dim=32, n_heads=2, n_kv_heads=1), hf)
    msg = error("hf-to-dcp", str(hf), str(tmp_path / "o"), "--model.flavor", "tiny")
    assert "'tiny' and" in msg and "differ in 4 field(s): dim: 32 (config.json) vs 64 (flavor)" in msg
    assert not (tmp_path / "o").exists()


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


# --- the adapter contract beyond renames: a checkpoint that fuses q, k, v (as Phi-3 stores them) ---------------

class _FusedQKV:
    """Llama's names, except each layer's q, k and v are one `qkv_proj` tensor: a fresh tensor in to_hf (so
    loading fills it and from_hf splits it back), not a view of ours."""

    def __init__(self, args):
        from tessera.models.llama3 import hf

        self.llama, self.sizes = hf, [args.n_heads * args.head_dim] + [args.n_kv_heads * args.head_dim] * 2
        self.hf_config, self.args_from_hf_config = hf.hf_config, hf.args_from_hf_config

    def to_hf(self, state: dict) -> dict:
        out = {k: v for k, v in self.llama.to_hf(state).items() if not k.endswith(("q_proj.weight", "k_proj.weight",
                                                                                     "v_proj.weight"))}
        for layer in sorted({k.split(".")[1] for k in state if ".attention.w" in k}):
            parts = [state.get(f"layers.{layer}.attention.w{x}.weight") for x in "qkv"]
            if all(p is not None for p in parts):
                out[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = torch.cat(parts)
        return out

    def from_hf(self, state: dict) -> dict:
        out = {}
        for k, v in state.items():
            if not k.endswith("self_attn.qkv_proj.weight"):
                out.update(self.llama.from_hf({k: v}))
                continue
            layer = k.split(".")[2]
            parts = v.split(self.sizes) if v is not None else (None,) * 3
            out.update({f"layers.{layer}.attention.w{x}.weight": p for x, p in zip("qkv", parts, strict=True)})
        return out


def test_an_adapter_that_fuses_and_splits_tensors_round_trips(tmp_path, monkeypatch):
    import safetensors

    from tessera.models import family

    args = _args()
    fused = dataclasses.replace(family("llama3"), hf=_FusedQKV(args))
    monkeypatch.setattr("tessera.models.family", lambda name: fused)
    ours = _ours(args)
    save_hf(ours, args, tmp_path)
    with safetensors.safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        assert "model.layers.1.self_attn.qkv_proj.weight" in names and not any("q_proj" in n for n in names)
        torch.testing.assert_close(f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")[64:96],
                                   ours.state_dict()["layers.1.attention.wk.weight"], rtol=0, atol=0)
    back = _ours(args, seed=None)
    load_hf(back, tmp_path)
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0, msg=name)
