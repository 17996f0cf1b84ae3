"""Kimi K2 through the DeepSeek V3 family: the kimi_k2 flavor's size (1T, 32B active), and a multimodal Kimi K2.5
folder's text model (`Kimi_K25ForConditionalGeneration`; not a preset) read as transformers saved it (its blocks
named `blocks.N`, the head tied by the top level's default) and as released (`layers.N`, text_config model_type
kimi_k2): logits, the DeepseekV3ForCausalLM export and greedy generation equal transformers'; the vision tower left
out with one line; a compressed-tensors form other than pack-quantized ints refused in one line (K2.5's INT4:
tests/test_quantized_releases.py)."""

import json
import logging

import pytest
import torch

from tessera.checkpoint.hf import HFError
from tessera.models import family
from tests.hf_parity import assert_round_trip, import_hf

DSV3 = family("deepseek_v3")
TEXT = dict(model_type="deepseek_v3", hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=6, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
            vocab_size=97, max_position_embeddings=128, num_nextn_predict_layers=0, bos_token_id=None,
            eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


@pytest.mark.fast
def test_the_kimi_k2_flavor_is_one_trillion_parameters_32b_active():
    counts = DSV3.counts(DSV3.flavors["kimi_k2"], 4096)
    assert 1.0e12 < counts.params < 1.05e12 and 31e9 < counts.active - counts.embedding < 33e9


def _kimi(path, **top):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(text_config=TEXT, **top))
    with torch.no_grad():  # the router, its bias and the norms made to count
        for name, p in model.model.language_model.named_parameters():
            if "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model.eval()


def test_a_kimi_k25_folder_transformers_saved_loads_its_text_model(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    theirs = _kimi(tmp_path / "in")  # tie_word_embeddings: Kimi_K25Config's default, true
    with caplog.at_level(logging.WARNING, logger="tessera"):
        ours, args = import_hf("deepseek_v3", tmp_path / "in")
    assert args.tie_embeddings and args.rope_theta == 50000.0 and args.arch() != DSV3.flavors["kimi_k2"].arch()
    assert any("tensors of the vision tower and projector" in r.message and "not loaded" in r.message
               for r in caplog.records)
    assert_round_trip(theirs, ours, args, transformers.DeepseekV3ForCausalLM, tmp_path / "in", tmp_path)


def test_the_released_layout_loads_and_other_compressed_forms_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    theirs = _kimi(tmp_path / "saved", tie_word_embeddings=False)
    released = tmp_path / "released"
    released.mkdir()
    state = load_file(tmp_path / "saved/model.safetensors")
    save_file({k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in state.items()},
              released / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "saved/config.json").read_text())
    config["text_config"]["model_type"] = "kimi_k2"  # as the release's config.json says it
    (released / "config.json").write_text(json.dumps(config))
    ours, args = import_hf("deepseek_v3", released)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (released / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFError, match="config.json: quantization_config format nvfp4-pack-quantized of "
                                      "compressed-tensors; Tessera dequantizes its pack-quantized int weights"):
        import_hf("deepseek_v3", released)
    assert not args.tie_embeddings  # the top level says false here
