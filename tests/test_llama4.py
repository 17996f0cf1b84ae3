"""Llama 4 (text): counts against the published ones; logits (after import and after export) and greedy generation
against transformers for tiny random configs with NoPE layers, chunks shorter than the sequences, the L2 q/k
norm, temperature tuning, Llama 3 RoPE scaling, dense layers between MoE ones and the shared expert; a released
(multimodal) checkpoint's text model imported, also under EP, and exported as Llama4ForCausalLM; configs Tessera
does not compute refused naming the field; FSDP, EP, CP, TP, PP and an 8-rank composition equal to one process;
the debug model trains."""

import dataclasses
import json

import pytest
import torch

from tessera.generate import from_pretrained
from tessera.models import family, hf_args, num_params
from tests.hf_parity import assert_round_trip, import_hf

LLAMA4 = family("llama4")


@pytest.mark.parametrize("flavor, total, active", [("17bx16e", 109, 17), ("17bx128e", 400, 17)])
def test_parameter_counts_and_layer_patterns_match_the_published_ones(flavor, total, active):
    """Scout: MoE in every layer; Maverick: every other one (1, 3, ...), dense between; both a NoPE layer every
    4th (3, 7, ...). 17B active counts every weight a token meets, both embeddings included."""
    args = LLAMA4.flavors[flavor]
    counts = LLAMA4.counts(args, 8192)
    assert abs(counts.params / 1e9 - total) / total < 0.02 and abs(counts.active / 1e9 - active) / active < 0.02
    assert [i for i in range(48) if not args.uses_rope(i)] == list(range(3, 48, 4))
    assert [i for i in range(48) if args.is_moe(i)] == list(range(48) if flavor == "17bx16e" else range(1, 48, 2))
    with torch.device("meta"):
        model = LLAMA4.spec().model(dataclasses.replace(LLAMA4.flavors["debugmodel"], vocab_size=258))
    assert LLAMA4.counts(model.args, 32).params == num_params(model)


_CONFIGS = {  # not presets; sequences of 32 (and generation to 16) cross several chunks
    "scout_like": dict(interleave_moe_layer_step=1, use_qk_norm=True, attention_chunk_size=8, no_rope_layer_interval=2,
                       rope_parameters={
                           "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "maverick_like_pattern": dict(interleave_moe_layer_step=2, use_qk_norm=False, attention_chunk_size=5,
                                  num_experts_per_tok=2, no_rope_layers=[1, 0, 1, 1],
                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}


def _theirs(path, vocab_size: int = 97, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.Llama4TextConfig(**{
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
        "num_experts_per_tok": 1, "vocab_size": vocab_size, "max_position_embeddings": 64,
        "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 1.0,  # steps every 4 positions
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **overrides})
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():  # HF starts norms at 1, the experts at 0, q and k small: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name or "router" in name or "q_proj" in name or "k_proj" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **_CONFIGS[name])
    ours, args = import_hf("llama4", tmp_path / "in")
    assert_round_trip(theirs, ours, args, transformers.Llama4ForCausalLM, tmp_path / "in", tmp_path)


def test_each_feature_changes_the_logits(tmp_path, monkeypatch):
    """The parity above is not vacuous: without the chunks, the L2 norm or the temperature, or rotating halves
    instead of pairs, the logits move by over 100 times its tolerance."""
    from tessera.models.common.rope import apply_rope
    from tessera.models.llama4 import model as llama4_model

    _theirs(tmp_path / "in", **_CONFIGS["scout_like"])
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    ours, _ = import_hf("llama4", tmp_path / "in")
    with torch.no_grad():
        base = ours(tokens)
        for switch in ("chunk", "l2", "temperature", "halves"):
            model, _ = import_hf("llama4", tmp_path / "in")
            for block in model.layers.values():
                attention = block.attention
                attention.sdpa.chunk = 0 if switch == "chunk" else attention.sdpa.chunk
                attention.l2_eps = None if switch == "l2" else attention.l2_eps
                attention.tuned = attention.tuned and switch != "temperature"
            with monkeypatch.context() as patch:
                if switch == "halves":
                    patch.setattr(llama4_model, "rotate_pairs", lambda x, table: apply_rope(x, table[:, :2]))
                assert (model(tokens) - base).abs().max() > 1e-3, switch


def _multimodal(folder, theirs):
    """A released checkpoint's layout: Llama4ForConditionalGeneration with `theirs` as its language model (and
    a tiny vision tower, which the import leaves out)."""
    import transformers

    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
              "image_size": 32, "patch_size": 16, "vision_output_dim": 32, "projector_input_dim": 32,
              "projector_output_dim": 32, "pixel_shuffle_ratio": 0.5}
    config = transformers.Llama4Config(text_config=theirs.config.to_dict(), vision_config=vision)
    model = transformers.Llama4ForConditionalGeneration(config)
    model.language_model.load_state_dict(theirs.state_dict())
    model.save_pretrained(folder)


def test_a_released_multimodal_checkpoint_imports_its_text_model(tmp_path):
    theirs = _theirs(tmp_path / "text", **_CONFIGS["scout_like"])
    _multimodal(tmp_path / "mm", theirs)
    ours, args = import_hf("llama4", tmp_path / "mm")
    assert args == dataclasses.replace(hf_args("llama4", str(tmp_path / "text")), max_seq_len=32)
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
        # from_pretrained finds the family through text_config, and keeps the RoPE table at most 128k long
        model, _ = from_pretrained(tmp_path / "mm")
        torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    assert model.rope.shape[0] == 64  # the config's max_position_embeddings, under the cap
    with open(tmp_path / "mm" / "config.json") as fh:
        config = json.load(fh)
    config["text_config"]["max_position_embeddings"] = 10_485_760  # Scout's
    with open(tmp_path / "mm" / "config.json", "w") as fh:
        json.dump(config, fh)
    assert from_pretrained(tmp_path / "mm")[0].rope.shape[0] == 131072


def _config(**changes) -> dict:
    return {**LLAMA4.hf.hf_config(dataclasses.replace(LLAMA4.flavors["debugmodel"], vocab_size=258)), **changes}


@pytest.mark.parametrize("config, message", [
    (_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type = 'yarn'"),
    (_config(hidden_act="gelu"), "hidden_act = 'gelu'"),
    (_config(attention_bias=True), "attention_bias = True"),
    (_config(no_rope_layers=[1, 0]), r"no_rope_layers = \[1, 0\]: one entry per layer"),
    (_config(moe_layers=[1, 4]), r"moe_layers = \[1, 4\]: layer indices below num_hidden_layers"),
    (_config(layer_types=["full_attention"] * 4), "layer_types = .*chunks exactly the RoPE layers"),
    ({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}, "text_config is missing"),
])
def test_configs_tessera_does_not_compute_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        LLAMA4.hf.args_from_hf_config(config)


def test_tp_must_divide_the_dense_layers_ffn():
    args = dataclasses.replace(LLAMA4.flavors["debugmodel"], n_kv_heads=4, ffn_hidden=130, vocab_size=256)
    with pytest.raises(ValueError, match=r"^parallelism.tensor_parallel_degree: 4 does not divide the FFN hidden"):
        LLAMA4.check_layout(args, 4, 1, 1, "llama4 test")
    LLAMA4.check_layout(dataclasses.replace(args, moe_step=1), 4, 1, 1, "llama4 test")  # no dense layer to split


MODEL = ["--model.name", "llama4", "--model.flavor", "debugmodel", "--moe.load_balance_rate", "1e-2"]
BATCH = "--training.local_batch_size"
PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
TP, EP = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "2"]
CP = ["--parallelism.context_parallel_degree", "2"]


@pytest.fixture(scope="module")
def reference():
    from tests.launch import one_process

    return one_process([*MODEL, BATCH, "8"], 4)


@pytest.mark.ranks
def test_fsdp_ep_cp_tp_and_pp_equal_one_process(tmp_path, reference):
    """2 ranks, the bias update on, per-step losses and grad norms, step-1 gradients and final parameters within
    1e-5: FSDP 2; EP 2; CP 2 (chunks of 12 crossing CP's pieces of 8, the NoPE layer's temperature at each
    token's global position); TP 2 (heads split, the dense layers' SwiGLU too); PP 2 (a MoE and a dense layer
    on each stage); and EP 2 on weights imported from a multimodal checkpoint (each rank its experts' slices of
    the fused tensors)."""
    from tests.launch import assert_matches, one_process, run_cases

    _multimodal(tmp_path / "mm", _theirs(tmp_path / "text", vocab_size=300, **_CONFIGS["scout_like"]))
    hf = ["--model.name", "llama4", "--model.flavor=", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
          "--checkpoint.initial_load_path", str(tmp_path / "mm"), "--moe.load_balance_rate", "1e-2"]
    cases = [[*MODEL, BATCH, "4"], [*MODEL, BATCH, "4", *EP], [*MODEL, BATCH, "8", *CP], [*MODEL, BATCH, "8", *TP],
             [*MODEL, BATCH, "8", *PP], [*hf, BATCH, "4", *EP]]
    *layouts, imported = run_cases(2, cases, 4)
    for got in layouts:
        assert_matches(got, reference, 1e-5, what=("grads", "params"))
    assert_matches(imported, one_process([*hf, BATCH, "8"], 4), 1e-5, what=("grads", "params"))


@pytest.mark.ranks
def test_cp4_ep2_x_cp2_and_tp2_x_cp2_equal_one_process(tmp_path, reference):
    """4 ranks: CP 4 (pieces of 4, a chunk spanning three of them), EP 2 x CP 2, TP 2 x CP 2; and with short
    documents packed into each window (block_causal: chunks and the NoPE temperature count from each document's
    start), CP 2 x FSDP 2 and PP 2 x FSDP 2 (documents and positions reach every stage)."""
    import json

    from tests.launch import assert_matches, one_process, run_cases

    docs = tmp_path / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {k}: " + "ab cd " * (k % 5)}) + "\n" for k in range(400)))
    packed = [*MODEL, "--training.dataset", "files", "--training.dataset_path", str(docs),
              "--model.attn_mask_type", "block_causal"]
    cases = [[*MODEL, BATCH, "8", "--parallelism.context_parallel_degree", "4"], [*MODEL, BATCH, "4", *EP, *CP],
             [*MODEL, BATCH, "8", *TP, *CP], [*packed, BATCH, "4", *CP], [*packed, BATCH, "4", *PP]]
    *plain, cp_docs, pp_docs = run_cases(4, cases, 4)
    for got in plain:
        assert_matches(got, reference, 1e-5, what=("grads", "params"))
    one = one_process([*packed, BATCH, "8"], 4)
    for got in (cp_docs, pp_docs):
        assert_matches(got, one, 1e-5, what=("grads", "params"))


@pytest.mark.ranks
def test_8_ranks_pp_x_tp_x_fsdp_x_ep_equal_one_process(tmp_path, reference):
    from tests.launch import assert_matches, run_cases

    (got,) = run_cases(8, [[*MODEL, BATCH, "4", *PP, *TP, *EP]], 4)
    assert_matches(got, reference, 1e-5, what=("grads", "params"))


@pytest.mark.ranks
def test_the_trainer_exports_what_it_imported_with_experts_sharded(tmp_path):
    """From a multimodal checkpoint under EP 2 x FSDP (each rank reading its experts' slices of the fused
    tensors), lr 0: the Llama4ForCausalLM export holds the text model's weights exactly."""
    from transformers import Llama4ForCausalLM

    from tests.launch import run_dist

    theirs = _theirs(tmp_path / "text", vocab_size=300, **_CONFIGS["maverick_like_pattern"])
    _multimodal(tmp_path / "mm", theirs)
    run_dist(2, tmp_path / "run", "--model.name", "llama4", "--model.flavor=", "--training.steps", "1",
             "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable",
             "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf", "--checkpoint.initial_load_path",
             str(tmp_path / "mm"), "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2")
    exported = Llama4ForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint/exports/step-1").state_dict()
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


def test_the_debug_model_trains():
    from tests.dist_worker import run_train

    history = run_train(["--model.name", "llama4", "--model.flavor", "debugmodel", "--training.seq_len", "128",
                         BATCH, "8", "--optimizer.lr", "3e-3"], 40)["history"]
    assert history[-1]["loss"] < history[0]["loss"] - 1.0 and "moe_imbalance" in history[-1]
