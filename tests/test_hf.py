"""Hugging Face interop: safetensors in and out (one process and FSDP-sharded), exact or refused, and the adapter
contract. The CLI, the download script and the trainer's HF runs are in test_hf_workflows.py.

Run as a script under torchrun, this file is the 2-rank worker of `test_fsdp_save_and_load_hf`.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.checkpoint.hf import HFError, load_hf, save_hf
from tessera.models.common.decoder import Decoder as Transformer
from tessera.models.llama3.args import FLAVORS
from tessera.models.llama3.hf import hf_config
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


# --- 2 ranks: FSDP-sharded save and load --------------------------------------------------------------------


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.ranks
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
