"""GPT-OSS: counts against the published ones; logits (after import and after export) and greedy generation
against transformers for tiny random configs with sliding windows shorter than the sequences, sinks, YaRN and
the clamped SwiGLU; MXFP4 experts dequantized on import (in one process and under EP); HF import and export
with sharded experts; FSDP, EP, CP, TP, PP and an 8-rank composition equal to one process."""

import dataclasses
import json

import pytest
import torch

from tessera.checkpoint.hf import load_hf
from tessera.models import family, hf_args, num_params
from tests.hf_parity import assert_round_trip

OSS = family("gpt_oss")


@pytest.mark.parametrize("flavor, total, active", [("20b", 20.9, 3.6), ("120b", 116.8, 5.1)])
def test_parameter_counts_match_the_published_ones(flavor, total, active):
    counts = OSS.counts(OSS.flavors[flavor], 4096)
    active_b = (counts.active - counts.embedding) / 1e9  # published: without the input embedding
    assert abs(counts.params / 1e9 - total) / total < 0.01 and abs(active_b - active) / active < 0.02
    with torch.device("meta"):
        model = OSS.spec().model(dataclasses.replace(OSS.flavors["debugmodel"], vocab_size=258))
    assert OSS.counts(model.args, 32).params == num_params(model)


_CONFIGS = {  # not presets: windows of 4 and 7 under sequences of 32; alternating or another pattern; YaRN or not
    "alternating_yarn": dict(sliding_window=4, rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
    "pattern_plain_rope": dict(sliding_window=7, layer_types=["full_attention", "sliding_attention",
                                                              "sliding_attention"],
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def _theirs(path, vocab_size: int = 97, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(**{
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": vocab_size, "max_position_embeddings": 64, "swiglu_limit": 1.5,  # the clamp bites
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **overrides})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # HF starts biases, sinks and the router at 0 and norms at 1: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name or "sinks" in name or "router" in name or "experts" in name:
                p.normal_(0, 0.5 if "sinks" in name else 0.3)
    model.save_pretrained(path)
    return model


def _ours(folder):
    args = dataclasses.replace(hf_args("gpt_oss", str(folder)), max_seq_len=32)
    with torch.device("meta"):
        model = OSS.spec().model(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    load_hf(model.eval(), folder)
    return model, args


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **_CONFIGS[name])
    ours, args = _ours(tmp_path / "in")
    assert_round_trip(theirs, ours, args, transformers.GptOssForCausalLM, tmp_path / "in", tmp_path)


MODEL = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--moe.load_balance_rate", "1e-2"]
PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
TP, EP = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "2"]


@pytest.fixture(scope="module")
def reference():
    from tests.launch import one_process

    return one_process([*MODEL, "--training.local_batch_size", "8"], 4)


@pytest.mark.ranks
def test_fsdp_ep_cp_tp_and_pp_equal_one_process(tmp_path, reference):
    """2 ranks, the bias update on: FSDP 2; EP 2 (the experts' biases split with them); CP 2 (each rank's
    query chunks see the keys their window allows, with the sinks); TP 2 (each rank its heads' sinks); PP 2."""
    from tests.launch import assert_matches, run_cases

    batch, cp = "--training.local_batch_size", ["--parallelism.context_parallel_degree", "2"]
    cases = [[*MODEL, batch, "4"], [*MODEL, batch, "4", *EP], [*MODEL, batch, "8", *cp], [*MODEL, batch, "8", *TP],
             [*MODEL, batch, "8", *PP]]
    for got in run_cases(2, cases, 4):
        assert_matches(got, reference, 1e-5, what=("grads", "params"))


@pytest.mark.ranks
def test_8_ranks_pp_x_tp_x_fsdp_x_ep_equal_one_process(tmp_path, reference):
    from tests.launch import assert_matches, run_cases

    (got,) = run_cases(8, [[*MODEL, "--training.local_batch_size", "4", *PP, *TP, *EP]], 4)
    assert_matches(got, reference, 1e-5, what=("grads", "params"))


def test_the_debug_model_trains():
    from tests.dist_worker import run_train

    history = run_train(["--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--training.seq_len", "128",
                         "--training.local_batch_size", "8", "--optimizer.lr", "3e-3"], 40)["history"]
    assert history[-1]["loss"] < history[0]["loss"] - 1.0 and "moe_imbalance" in history[-1]


@pytest.mark.ranks
def test_the_trainer_imports_and_exports_hf_with_experts_sharded(tmp_path):
    """Under EP 2 and FSDP 2 each rank reads and writes only its experts of the fused, transposed tensors (a
    layout rewrapped per rank; experts FSDP splits by rows are regrouped by experts for it); lr 0 keeps the
    weights, so the export equals the HF model exactly. From MXFP4 blocks under EP 2, the export holds the
    dequantized experts exactly."""
    from transformers import GptOssForCausalLM

    from tests.launch import run_dist

    theirs = _theirs(tmp_path / "hf_in", vocab_size=300, **_CONFIGS["alternating_yarn"])
    run = ["--model.name", "gpt_oss", "--model.flavor=", "--training.steps", "1", "--optimizer.lr", "0",
           "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
           "--checkpoint.last_save_in_hf", "--checkpoint.initial_load_path", str(tmp_path / "hf_in"),
           "--training.local_batch_size", "2"]
    ep = ["--parallelism.expert_parallel_degree", "2"]
    for name, layout in (("ep", ep), ("fsdp", []), ("fsdp_rows", ["--parallelism.expert_fsdp_shard", "rows"])):
        run_dist(2, tmp_path / name, *run, *layout)
        exported = GptOssForCausalLM.from_pretrained(tmp_path / name / "checkpoint/exports/step-1")
        for key, value in theirs.state_dict().items():
            torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0, msg=f"{name} {key}")
    exact = _to_mxfp4(tmp_path / "hf_in")  # MXFP4 experts under EP 2: each rank dequantizes its own blocks
    run_dist(2, tmp_path / "mxfp4", *run, *ep)
    exported = GptOssForCausalLM.from_pretrained(tmp_path / "mxfp4" / "checkpoint/exports/step-1").state_dict()
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(exported[key], exact.get(key, value), rtol=0, atol=0, msg=f"mxfp4 {key}")


def _to_mxfp4(folder) -> dict:
    """Rewrite the folder's expert tensors as MXFP4 blocks and scales (as the released checkpoints store them);
    returns the dequantized values each stands for, in HF's layout."""
    import json

    from safetensors.torch import load_file, save_file

    from tessera.checkpoint.mxfp4 import FP4

    state, exact = load_file(folder / "model.safetensors"), {}
    lut = torch.tensor(FP4)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = state.pop(name).transpose(-1, -2)  # [E, rows, cols]: 32 values of a row share a scale
        groups = rows.reshape(*rows.shape[:-1], -1, 32)
        exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
        scaled = groups / torch.exp2(exponent)[..., None]
        index = (scaled[..., None] - lut).abs().argmin(-1)  # nearest FP4 value (the sign of zero is moot)
        blocks = (index[..., 0::2] | (index[..., 1::2] << 4)).to(torch.uint8)
        state[name + "_blocks"], state[name + "_scales"] = blocks, (exponent + 127).to(torch.uint8)
        exact[name] = (lut[index] * torch.exp2(exponent)[..., None]).reshape(rows.shape).transpose(-1, -2)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return exact


def test_mxfp4_experts_are_dequantized_on_import(tmp_path):
    """Each expert tensor equals its FP4 values times their power-of-two scales exactly (and transformers' own
    MXFP4 dequantization of the fixture), and the logits equal transformers' given those dequantized weights;
    a folder of blocks without the mxfp4 config is refused."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tessera.checkpoint.hf import HFError

    theirs = _theirs(tmp_path / "in", **_CONFIGS["alternating_yarn"])
    exact = _to_mxfp4(tmp_path / "in")
    packed = load_file(tmp_path / "in" / "model.safetensors")
    for name, value in exact.items():
        their_dequant = convert_moe_packed_tensors(packed[name + "_blocks"], packed[name + "_scales"],
                                                   dtype=torch.float32)
        torch.testing.assert_close(their_dequant, value, rtol=0, atol=0, msg=name)
    ours, args = _ours(tmp_path / "in")
    got = OSS.hf.to_hf(ours.state_dict())
    with torch.no_grad():
        for name, value in exact.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
        state = theirs.state_dict()
        state.update(exact)
        theirs.load_state_dict(state)
        tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    config = (tmp_path / "in" / "config.json")
    unquantized = {k: v for k, v in json.loads(config.read_text()).items() if k != "quantization_config"}
    config.write_text(json.dumps(unquantized))
    with pytest.raises(HFError, match="holds MXFP4 blocks .* no mxfp4 quantization_config"):
        load_hf(ours, tmp_path / "in")
