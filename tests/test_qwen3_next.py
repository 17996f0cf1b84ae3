"""Qwen3-Next (the Qwen 3.5 group's qwen3_next family): counts against the models built, logits / both HF
directions / greedy generation against transformers' Qwen3NextForCausalLM on configs that are no preset (dense
blocks among the MoE ones by decoder_sparse_step and mlp_only_layers, unrenormalized routing weights, three value
heads per key head), in a folder transformers saved and in the released layout; its layouts are in
tests/test_qwen3_5.py's launch."""

import dataclasses
import json
import re

import pytest
import torch

from tessera.checkpoint.hf import HFError, load_hf
from tessera.models import family, hf_args, num_params
from tests.hf_parity import assert_round_trip, import_hf

NEXT = family("qwen3_next")
L, F = "linear_attention", "full_attention"


@pytest.mark.fast
def test_counts_equal_the_models_built_and_the_released_size():
    for args in NEXT.flavors.values():
        with torch.device("meta"):
            model = NEXT.spec().model(dataclasses.replace(args, vocab_size=args.vocab_size or 256))
        assert NEXT.counts(model.args, 128).params == num_params(model)
    released = NEXT.counts(NEXT.flavors["80B-A3B"], 4096)
    assert 79e9 < released.params < 81e9 and 3e9 < released.active - released.embedding < 4e9  # "80B-A3B"
    debug = NEXT.flavors["debugmodel_next"]
    assert debug.sparse_layers == (1, 3) and [debug.moe.sparse(i) for i in range(4)] == [False, True, False, True]


ODD = {  # transformers' Qwen3NextConfig fields; none is a preset
    "sparse_step_and_mlp_only": dict(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False,
                                     layer_types=[L, F, L, L], linear_num_value_heads=6),
    "every_block_moe": dict(layer_types=[F, L, L, F], num_key_value_heads=1, linear_conv_kernel_dim=3,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e5, "partial_rotary_factor": 0.5}),
}


def _theirs(path, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3NextConfig(**{**dict(
        hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        max_position_embeddings=128, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, intermediate_size=56, bos_token_id=None, eos_token_id=None), **overrides})
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # HF starts norms at 0 (1-centred) and the router at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name or "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(ODD))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **ODD[case])
    ours, args = import_hf("qwen3_next", tmp_path / "in", 80)
    assert all(args.arch() != f.arch() for f in NEXT.flavors.values())
    assert NEXT.counts(args, 32).params == num_params(ours)
    assert [args.moe.sparse(i) for i in range(4)] == [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in theirs.model.layers]
    for module in ours.modules():  # several chunks in 80 tokens (transformers' is 64)
        if hasattr(module, "chunk_size"):
            module.chunk_size = 16
    tokens = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    assert_round_trip(theirs, ours, args, transformers.Qwen3NextForCausalLM, tmp_path / "in", tmp_path)


def test_the_released_layout_loads_and_a_bad_block_list_is_refused_in_one_line(tmp_path):
    """The released safetensors (fused expert stacks, an MTP head beside the model) load to transformers' logits;
    an mlp_only_layers entry past the last block is refused naming the file."""
    from safetensors.torch import save_file

    theirs = _theirs(tmp_path / "hf", **ODD["sparse_step_and_mlp_only"])
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text((tmp_path / "hf/config.json").read_text())
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    save_file({**state, "mtp.fc.weight": torch.zeros(48, 96)}, released / "model.safetensors",
              metadata={"format": "pt"})
    ours, _ = import_hf("qwen3_next", released)
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    config = json.loads((released / "config.json").read_text())
    (released / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [4]}))
    with pytest.raises(ValueError, match=re.escape(f"{released / 'config.json'}: decoder_sparse_step = 2 (>= 1) and "
                                                   f"mlp_only_layers = [4] (blocks 0..3) pick the MoE blocks")):
        hf_args("qwen3_next", str(released))
    with torch.device("meta"):
        other = NEXT.spec().model(dataclasses.replace(ours.args, norm_topk_prob=True))
    other.to_empty(device="cpu")
    (released / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFError, match="describes another model than the one built, in 1 field"):
        load_hf(other, released)
