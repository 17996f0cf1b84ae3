"""GPT-OSS: counts against the published ones; logits (after import and after export) and greedy generation
against transformers for tiny random configs with sliding windows shorter than the sequences, sinks, YaRN and
the clamped SwiGLU; FSDP, EP, CP, TP, PP and an 8-rank composition equal to one process."""

import dataclasses

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


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **_CONFIGS[name])
    args = dataclasses.replace(hf_args("gpt_oss", str(tmp_path / "in")), max_seq_len=32)
    with torch.device("meta"):
        ours = OSS.spec().model(args)
    ours.to_empty(device="cpu")
    ours.init_buffers(torch.device("cpu"))
    load_hf(ours.eval(), tmp_path / "in")
    assert_round_trip(theirs, ours, args, transformers.GptOssForCausalLM, tmp_path / "in", tmp_path)


MODEL = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--moe.load_balance_rate", "1e-2"]
PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
TP, EP = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "2"]


@pytest.fixture(scope="module")
def reference():
    from tests.dist_worker import run_grads

    return run_grads([*MODEL, "--training.local_batch_size", "8"], 4)


def test_fsdp_ep_cp_tp_and_pp_equal_one_process(tmp_path, reference):
    """2 ranks, the bias update on: FSDP 2; EP 2 (the experts' biases split with them); CP 2 (each rank's
    query chunks see the keys their window allows, with the sinks); TP 2 (each rank its heads' sinks); PP 2."""
    from tests.launch import assert_matches, run_cases

    batch, cp = "--training.local_batch_size", ["--parallelism.context_parallel_degree", "2"]
    cases = [[*MODEL, batch, "4"], [*MODEL, batch, "4", *EP], [*MODEL, batch, "8", *cp], [*MODEL, batch, "8", *TP],
             [*MODEL, batch, "8", *PP]]
    for got in run_cases(2, tmp_path, cases, 4):
        assert_matches(got, reference, 1e-5, what=("grads", "params"))


def test_8_ranks_pp_x_tp_x_fsdp_x_ep_equal_one_process(tmp_path, reference):
    from tests.launch import assert_matches, run_cases

    (got,) = run_cases(8, tmp_path, [[*MODEL, "--training.local_batch_size", "4", *PP, *TP, *EP]], 4)
    assert_matches(got, reference, 1e-5, what=("grads", "params"))


def test_the_debug_model_trains():
    from tests.dist_worker import run_train

    history = run_train(["--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--training.seq_len", "128",
                         "--training.local_batch_size", "8", "--optimizer.lr", "3e-3"], 40)["history"]
    assert history[-1]["loss"] < history[0]["loss"] - 1.0 and "moe_imbalance" in history[-1]
