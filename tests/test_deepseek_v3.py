"""DeepSeek V3: counts against the published ones, MLA + DeepSeek MoE logits, both HF directions and greedy
generation against transformers for tiny random configs (with and without the query bottleneck, interleaved
RoPE, YaRN), FP8 block-quantized checkpoints dequantized on import, FSDP 2 x EP 2 equal to one process."""

import dataclasses
import json

import pytest
import torch

from tessera.checkpoint.hf import load_hf, save_hf
from tessera.generate import from_pretrained, generate
from tessera.models import family, hf_args, num_params

DSV3 = family("deepseek_v3")


@pytest.mark.parametrize("flavor, total, active", [("16B", 15.7, 2.4), ("236B", 236, 21), ("671B", 671, 37)])
def test_parameter_counts_match_the_published_ones(flavor, total, active):
    counts = DSV3.counts(DSV3.flavors[flavor], 4096)
    active_b = (counts.active - counts.embedding) / 1e9  # published: without the input embedding
    assert abs(counts.params / 1e9 - total) / total < 0.02 and abs(active_b - active) / active < 0.03
    for args in (DSV3.flavors["debugmodel"], dataclasses.replace(DSV3.flavors["debugmodel"], q_lora_rank=0)):
        with torch.device("meta"):
            model = DSV3.spec().model(dataclasses.replace(args, vocab_size=258))
        assert DSV3.counts(model.args, 32).params == num_params(model)


_CONFIGS = {  # not presets: a query bottleneck or not, pairs or halves RoPE, YaRN with its softmax scale
    "q_lora_interleaved_yarn": dict(q_lora_rank=24, rope_interleave=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "plain_q_halves": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1),
}


def _theirs(path, vocab_size: int = 97, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(**{
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "vocab_size": vocab_size, "max_position_embeddings": 64, "num_mtp_layers": 0,
        "bos_token_id": None, "eos_token_id": None, **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # HF starts the router and its bias at 0 and norms at 1: make them count
        for name, p in model.named_parameters():
            if "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    return model


def _ours(path, seq: int = 32):
    args = dataclasses.replace(hf_args("deepseek_v3", str(path)), max_seq_len=seq)
    with torch.device("meta"):
        model = DSV3.spec().model(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    load_hf(model.eval(), path)
    return model, args


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **_CONFIGS[name])
    ours, args = _ours(tmp_path / "in")
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
        save_hf(ours, args, tmp_path / "out")
        back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    model, _ = from_pretrained(tmp_path / "in")
    prompt = [3, 17, 42, 5]
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert generate(model, prompt, 12) == want[0, len(prompt):].tolist()


def _quantize_fp8(folder, block: int) -> None:
    """Rewrite an HF folder's 2-D projection weights as float8_e4m3fn blocks with inverse scales, the way
    DeepSeek V3's released checkpoints are stored (quantization_config fp8, weight_block_size)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text()) \
        if (folder / "model.safetensors.index.json").exists() else None
    files = sorted(folder.glob("*.safetensors"))
    weight_map = {}
    for file in files:
        state, out = load_file(file), {}
        for name, w in state.items():
            out[name] = w
            if w.dim() == 2 and "proj" in name and "norm" not in name:
                rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
                padded = torch.zeros(rows * block, cols * block)
                padded[:w.shape[0], :w.shape[1]] = w
                tiles = padded.view(rows, block, cols, block)
                scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
                q = (tiles / scale[:, None, :, None]).view_as(padded)[:w.shape[0], :w.shape[1]]
                out[name] = q.to(torch.float8_e4m3fn)
                out[name.replace(".weight", ".weight_scale_inv")] = scale.float()
        save_file(out, file, metadata={"format": "pt"})
        weight_map.update({n: file.name for n in out})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (folder / "config.json").write_text(json.dumps(config))
    del index


@pytest.mark.parametrize("block", [16, 128])
def test_fp8_block_quantized_checkpoints_are_dequantized_on_import(tmp_path, block):
    """Each weight equals its fp8 blocks times their inverse scales (blocks that overhang the edges included),
    so the logits equal transformers' given the same dequantized weights."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    _theirs(tmp_path / "in", **_CONFIGS["q_lora_interleaved_yarn"])
    _quantize_fp8(tmp_path / "in", block)
    ours, _ = _ours(tmp_path / "in")
    (tmp_path / "ref").mkdir()
    weight_map = {}
    for file in (tmp_path / "in").glob("*.safetensors"):
        state, plain = load_file(file), {}
        for name, w in state.items():
            scale = state.get(name.removesuffix(".weight") + ".weight_scale_inv")
            if name.endswith(".weight_scale_inv") or not name.endswith(".weight"):
                plain.update({} if name.endswith(".weight_scale_inv") else {name: w})
                continue
            if scale is not None:
                w = w.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
            plain[name] = w
        save_file(plain, tmp_path / "ref" / file.name, metadata={"format": "pt"})
        weight_map.update({n: file.name for n in plain})
    (tmp_path / "ref" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((tmp_path / "in" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "ref" / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(ours.state_dict()["layers.1.attention.wkv_b.weight"],
                               load_file(tmp_path / "ref" / weight_map[_KV_B])[_KV_B], rtol=0, atol=0)
    ref = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ref").eval()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)


_KV_B = "model.layers.1.self_attn.kv_b_proj.weight"


def test_fsdp_ep_pp_and_cp_layouts_equal_one_process(tmp_path):
    """4 ranks, with the bias update on: FSDP 4; EP 2 x FSDP 4 (experts sharded over both); PP 2 x EP 2 x FSDP,
    whose first stage holds the dense block; EP 2 x CP 2 (MLA's values narrower than its keys). Per-step
    losses and grad norms, step-1 gradients and final parameters equal one process within 1e-5."""
    from tests.dist_worker import run_grads
    from tests.launch import assert_matches, run_cases

    model = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--moe.load_balance_rate", "1e-2"]
    reference = run_grads([*model, "--training.local_batch_size", "8"], 4)
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
    cases = [[*model, "--training.local_batch_size", "2"],
             [*model, "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"],
             [*model, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2", *pp],
             [*model, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2",
              "--parallelism.context_parallel_degree", "2"]]
    for got in run_cases(4, tmp_path, cases, 4):
        assert_matches(got, reference, 1e-5, what=("grads", "params"))


def test_the_debug_model_trains_with_balancing_on():
    from tests.dist_worker import run_train

    history = run_train(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.seq_len", "128",
                         "--training.local_batch_size", "8", "--optimizer.lr", "3e-3"], 40)["history"]
    assert history[-1]["loss"] < history[0]["loss"] - 1.0 and "moe_imbalance" in history[-1]


def test_tensor_parallel_is_refused_up_front():
    from tessera.config import ConfigError, parse_args
    from tessera.config.validate import validate

    cfg = parse_args(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
                      "--parallelism.tensor_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="parallelism.tensor_parallel_degree: .*latent attention"):
        validate(cfg, 2)
