"""Qwen 3.5 (dense and MoE): the chunked Gated DeltaNet against its token-by-token recurrence (values and
gradients, any chunk size), packed documents equal to each document alone, logits / both HF directions / greedy
generation against transformers on configs that are no preset (mixed layer_types, GQA, odd head sizes), a
multimodal release's text weights, the decoding cache against the uncached path, and counts."""

import dataclasses
import json
import re

import pytest
import torch

from tessera.checkpoint.hf import load_hf
from tessera.generate import generate
from tessera.models import family, hf_args, num_params
from tessera.models.common.deltanet import GatedDeltaNet, chunk_gated_delta_rule, recurrent_gated_delta_rule
from tests.hf_parity import assert_cached_decoding_equals_whole, assert_round_trip, initialized

DENSE, MOE = family("qwen3_5"), family("qwen3_5_moe")
L, F = "linear_attention", "full_attention"


def _inputs(bsz: int, seq: int, heads: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(bsz, seq, heads, dk, generator=gen), dim=-1) for _ in "qk")
    v = torch.randn(bsz, seq, heads, dv, generator=gen)
    g = -torch.rand(bsz, seq, heads, generator=gen) * 0.5
    beta = torch.rand(bsz, seq, heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_delta_rule_equals_the_recurrence_values_and_gradients(chunk):
    assert_chunked_equals_recurrence(_inputs(2, 37, 3, 8, 6), chunk)


def assert_chunked_equals_recurrence(inputs: list[torch.Tensor], chunk: int) -> None:
    """The chunked rule equals the token-by-token one, values, final state and gradients, from a given state and
    on packed documents (inputs [2, 37, 3 heads, ...]: q, k of 8 dims, v of 6)."""
    documents = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [5] * 37])
    state = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(3))
    for docs, start in ((None, state), (documents, None)):
        want, want_state = recurrent_gated_delta_rule(*inputs, state=start, documents=docs)
        got, got_state = chunk_gated_delta_rule(*inputs, chunk_size=chunk, state=start, documents=docs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
        weights = torch.randn_like(want)
        grads = [torch.autograd.grad((out * weights).sum(), inputs) for out in (want, got)]
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.fast
def test_packed_documents_equal_each_document_alone():
    """The state and the convolution's window reset at each document's first token: the mixer on packed
    documents equals it on each alone, and so does the whole model (positions counted per document)."""
    torch.manual_seed(0)
    mixer = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6)
    for p in mixer.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    mixer.chunk_size = 8
    lengths = [5, 13, 1, 11]
    x = torch.randn(1, sum(lengths), 32)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    alone = torch.cat([mixer(part) for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(mixer(x, documents=documents), alone, rtol=1e-5, atol=1e-5)

    args = dataclasses.replace(DENSE.flavors["tiny"], vocab_size=50, max_seq_len=32)
    model = _random_model(DENSE, args)
    tokens = torch.randint(0, 50, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    alone = torch.cat([model(part) for part in tokens.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(model(tokens, documents=documents, positions=positions), alone, rtol=1e-5, atol=1e-5)


def _random_model(fam, args):
    model, gen = initialized(fam, args), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms at 0 (1-centred) and the like: perturbed, so that they count
                p.add_(torch.rand(p.shape, generator=gen) * 0.4)
    return model.eval()


@pytest.mark.fast
@pytest.mark.parametrize("fam", [DENSE, MOE], ids=["dense", "moe"])
def test_cached_decoding_equals_the_uncached_path(fam):
    """The cache keeps the DeltaNet's convolution inputs and state (and attention's keys and values): a prefill
    then one token at a time gives the logits of the whole sequence at once, and greedy generation agrees."""
    flavor = "tiny" if fam is DENSE else "debugmodel_moe"
    model = _random_model(fam, dataclasses.replace(fam.flavors[flavor], vocab_size=60, max_seq_len=40))
    assert_cached_decoding_equals_whole(model, 60)
    prompt = [3, 17, 42, 5]
    assert generate(model, prompt, 10, use_cache=True) == generate(model, prompt, 10, use_cache=False)


@pytest.mark.fast
def test_the_options_set_each_deltanet_layer_and_one_line_says_which_kernel_runs(caplog):
    from tessera.models.qwen3_5.options import Qwen35Options, apply_options

    with torch.device("meta"):
        model = DENSE.spec().model(dataclasses.replace(DENSE.flavors["tiny"], vocab_size=50))
    with caplog.at_level("INFO", logger="tessera"):
        apply_options(model, Qwen35Options(chunk_size=8, kernel="auto"), torch.device("cpu"), rank0=True)
        apply_options(model, Qwen35Options(chunk_size=8, kernel="auto"), torch.device("cpu"), rank0=True,
                      state_passing=True)
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert len(layers) == 2 and {(m.chunk_size, m.kernel) for m in layers} == {(8, "auto")}
    assert [r.getMessage() for r in caplog.records] == [
        "Gated DeltaNet (2 layers): the chunked torch path, 8 per chunk",
        "Gated DeltaNet (2 layers): the chunked torch path, 8 per chunk (all-gather CP: state passing)"]


@pytest.mark.fast
def test_muon_and_float8_take_the_projections_and_leave_the_per_head_parameters():
    """Muon orthogonalizes the projections (DeltaNet's too), attention's and the experts' matrices; the
    convolution's taps (a filter per channel), A_log, dt_bias and the norms go to AdamW. Float8 converts every block
    linear but the router and the shared expert's gate (1 wide: float8 GEMMs need multiples of 16, and gain
    nothing there)."""
    from tessera.parallel.quantize import apply_float8
    from tests.test_muon import _groups
    from tests.test_speed_features import _float8_cfg

    def leaves(names):
        return {n.split(".", 2)[2] if n.startswith("layers.") else n for n in names}

    mixers = {f"attention.w{p}.weight" for p in "qkvzbao"}
    for fam, flavor in ((DENSE, "tiny"), (MOE, "debugmodel_moe")):
        groups = _groups(fam.name, flavor, "--optimizer.name", "Muon", "--optimizer.weight_decay_exclude")
        muon = leaves(n for g in groups if g["muon"] for n in g["names"])
        ffn = {"feed_forward.experts.w1", "feed_forward.router.gate.weight", "feed_forward.shared.gate.weight",
               "feed_forward.shared.w2.weight"} if fam is MOE else {"feed_forward.w1.weight"}
        assert mixers | ffn <= muon and not {n for n in muon if "heads" in n or "norm" in n}, muon
        adamw = leaves(n for g in groups if not g["muon"] and not g["weight_decay"] for n in g["names"])
        assert {f"attention.heads.{n}" for n in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias")} <= adamw

    with torch.device("meta"):
        moe = MOE.spec().model(dataclasses.replace(MOE.flavors["debugmodel_moe"], vocab_size=50))
    converted = apply_float8(moe, _float8_cfg(filter_fqns=[]), torch.device("cpu"), MOE.high_precision)
    assert leaves(converted) == {*(m.removesuffix(".weight") for m in mixers),
                                 *(f"feed_forward.shared.w{i}" for i in (1, 2, 3))}


def test_counts_equal_the_models_built():
    for fam in (DENSE, MOE):
        for args in fam.flavors.values():
            with torch.device("meta"):
                model = fam.spec().model(dataclasses.replace(args, vocab_size=args.vocab_size or 256))
            assert fam.counts(model.args, 128).params == num_params(model)
    linear = DENSE.counts(DENSE.flavors["9B"], 2048).flops_per_token
    assert DENSE.counts(DENSE.flavors["9B"], 4096).flops_per_token - linear < 0.2 * linear  # 1 block in 4 grows


# --- Hugging Face both ways -----------------------------------------------------------------------------------

ODD = {  # transformers' Qwen3_5(Moe)TextConfig fields; none is a preset
    "mixed_gqa": dict(layer_types=[L, F, L]),
    "full_first_mqa": dict(layer_types=[F, L, L], num_key_value_heads=1,
                           linear_num_key_heads=1, linear_num_value_heads=3, linear_value_head_dim=10,
                           linear_conv_kernel_dim=3, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e5, "partial_rotary_factor": 0.5}),
}


def _theirs(path, moe: bool, multimodal: bool = False, **overrides):
    transformers = pytest.importorskip("transformers")
    text = {**dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=97, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=12, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                **(dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                        shared_expert_intermediate_size=40) if moe else dict(intermediate_size=80))), **overrides}
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    if multimodal:
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48)
        config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision)
        cls = getattr(transformers, f"{prefix}ForConditionalGeneration")
    else:
        config = getattr(transformers, f"{prefix}TextConfig")(**text)
        cls = getattr(transformers, f"{prefix}ForCausalLM")
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # HF starts norms at 0 (1-centred) or 1, and the router at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name or "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("fam, case", [(DENSE, "mixed_gqa"), (DENSE, "full_first_mqa"), (MOE, "mixed_gqa")],
                         ids=["dense-mixed_gqa", "dense-full_first_mqa", "moe-mixed_gqa"])
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, fam, case):
    transformers = pytest.importorskip("transformers")
    moe = fam is MOE
    theirs = _theirs(tmp_path / "in", moe, **ODD[case])
    args = dataclasses.replace(hf_args(fam.name, str(tmp_path / "in")), max_seq_len=80)
    assert all(args.arch() != f.arch() for f in fam.flavors.values())
    ours = _random_model(fam, args)
    assert fam.counts(args, 32).params == num_params(ours)
    for module in ours.modules():  # several chunks in 80 tokens (transformers' is 64)
        if isinstance(module, GatedDeltaNet):
            module.chunk_size = 16
    load_hf(ours, tmp_path / "in")
    tokens = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    assert_round_trip(theirs, ours, args, cls, tmp_path / "in", tmp_path)


@pytest.mark.fast
@pytest.mark.parametrize("key, value", [("attn_output_gate", False), ("mlp_only_layers", [1])])
def test_config_keys_the_hybrid_does_not_compute_are_refused_in_one_line(tmp_path, key, value):
    """A config.json with attention's output ungated, or dense MLPs in some blocks of the MoE, would be imported
    as something else: refused naming the key; the values releases carry (true, []) load."""
    config = dict(model_type="qwen3_5_moe_text", hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=97, num_experts=6, num_experts_per_tok=2,
                  moe_intermediate_size=24, shared_expert_intermediate_size=40, attn_output_gate=True,
                  mlp_only_layers=[])
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf_args(MOE.name, str(tmp_path)).n_layers == 3
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=rf"config.json: {key} = {re.escape(repr(value))}: Tessera's qwen3_5_moe "
                                         r"computes hidden_act = 'silu', attention_bias = False, "
                                         r"attn_output_gate = True, mlp_only_layers = \[\] and RoPE default only"):
        hf_args(MOE.name, str(tmp_path))


@pytest.mark.parametrize("fam", [DENSE, MOE], ids=["dense", "moe"])
def test_a_multimodal_release_loads_its_text_model(tmp_path, fam, caplog):
    """A ...ForConditionalGeneration folder: the text model under model.language_model., its config in
    text_config; the vision tower is left out with one line."""
    theirs = _theirs(tmp_path / "in", fam is MOE, multimodal=True, layer_types=[L, L, F])
    args = dataclasses.replace(hf_args(fam.name, str(tmp_path / "in")), max_seq_len=32)
    ours = _random_model(fam, args)
    with caplog.at_level("WARNING", logger="tessera"):
        load_hf(ours, tmp_path / "in")
    assert sum("vision tower" in r.message for r in caplog.records) == 1
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)


def test_the_released_moe_layout_loads_and_exports_as_released(tmp_path):
    """Released Qwen 3.5 MoE folders keep each layer's experts fused (`mlp.experts.gate_up_proj`, `down_proj`: the
    tensors transformers holds), the text model under `model.language_model.`: such a folder loads and generates
    what transformers does, and exports write that layout, which transformers reads back."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from tessera.checkpoint.hf import save_hf

    theirs = _theirs(tmp_path / "saved", True, multimodal=True, layer_types=[L, F, L])
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text((tmp_path / "saved/config.json").read_text())
    state = {name: value.contiguous() for name, value in theirs.state_dict().items()}
    fused = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert state[fused].shape == (6, 2 * 24, 48) and not any(".experts.0." in name for name in state)
    save_file(state, released / "model.safetensors", metadata={"format": "pt"})
    args = dataclasses.replace(hf_args(MOE.name, str(released)), max_seq_len=32)
    ours = _random_model(MOE, args)
    load_hf(ours, released)
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    prompt = [3, 17, 42, 5]
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert generate(ours.eval(), prompt, 12) == want[0, len(prompt):].tolist()
        save_hf(ours, args, tmp_path / "out")
        names = set(json.loads((tmp_path / "out/model.safetensors.index.json").read_text())["weight_map"])
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
        back = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(back(tokens).logits, theirs(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_releases_mtp_head_goes_unchanged_into_the_runs_export(tmp_path, capsys):
    """A release's MTP head (`mtp.*`, which Tessera does not train) is left out of the model of a run that starts
    from its folder, and written back unchanged, with its config.json keys, into the run's Hugging Face export (one
    line says so), which transformers loads."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tessera.train import main

    _theirs(tmp_path / "in", False, vocab_size=300)
    head = {"mtp.fc.weight": torch.randn(48, 96), "mtp.norm.weight": torch.randn(48),
            "mtp.layers.0.mlp.gate_proj.weight": torch.randn(80, 48)}
    save_file(head, tmp_path / "in/mtp.safetensors")
    config = json.loads((tmp_path / "in/config.json").read_text())
    (tmp_path / "in/config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    dump = tmp_path / "run"
    assert main(["--model.name", "qwen3_5", "--model.flavor=", "--training.steps", "2", "--training.seq_len", "32",
                 "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                 "--checkpoint.initial_load_path", str(tmp_path / "in"), "--checkpoint.last_save_in_hf",
                 "--job.dump_folder", str(dump), "--qwen3_5.chunk_size", "8"]) == 0
    export = dump / "checkpoint/exports/step-2"
    assert "MTP head of " in capsys.readouterr().out
    with safe_open(export / "model-carried.safetensors", "pt") as fh:
        assert sorted(fh.keys()) == sorted(head) and all(torch.equal(fh.get_tensor(n), head[n]) for n in head)
    assert json.loads((export / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    transformers.Qwen3_5ForCausalLM.from_pretrained(export)


# --- layouts: each equals one process -------------------------------------------------------------------------

STEPS = 3
_DENSE = ["--model.name", "qwen3_5", "--model.flavor", "tiny", "--qwen3_5.chunk_size", "8"]
_MOE = ["--model.name", "qwen3_5_moe", "--model.flavor", "debugmodel_moe", "--qwen3_5_moe.chunk_size", "8"]
_NEXT = ["--model.name", "qwen3_next", "--model.flavor", "debugmodel_next", "--qwen3_next.chunk_size", "8"]


@pytest.mark.ranks
def test_layouts_equal_one_process(tmp_path):
    """One 2-rank launch: FSDP (also with selective op AC), TP + SP (DeltaNet's heads, taps and decay split by
    head; also with each block compiled whole-graph: the chunked DeltaNet's scan, triangular solves and causal
    convolution trace without a break), PP (each stage a DeltaNet and a full-attention block) of the dense model;
    EP and TP of the MoE one; EP (FSDP beside it on the dense blocks), PP (each stage a dense and a MoE block) and TP
    of Qwen3-Next's.
    Losses, grad norms and step-1 gradients equal a single process's (fp32)."""
    from tests.launch import assert_matches, one_process, run_cases

    refs = {name: one_process([*argv, "--training.local_batch_size", "8"], STEPS)
            for name, argv in (("dense", _DENSE), ("moe", _MOE), ("next", _NEXT))}
    tp, pp = ("--parallelism.tensor_parallel_degree", "2"), ("--parallelism.pipeline_parallel_degree", "2")
    cases = {"dense fsdp2": [*_DENSE, "--training.local_batch_size", "4"],
             "dense tp2": [*_DENSE, "--training.local_batch_size", "8", *tp],
             "dense tp2 compiled": [*_DENSE, "--training.local_batch_size", "8", *tp, "--compile.enable",
                                    "--compile.components", "model"],
             "dense fsdp2 op AC": [*_DENSE, "--training.local_batch_size", "4", "--activation_checkpoint.mode",
                                   "selective", "--activation_checkpoint.selective_ac_option", "op"],
             "dense pp2": [*_DENSE, "--training.local_batch_size", "8", *pp],
             "moe ep2": [*_MOE, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
             "moe tp2": [*_MOE, "--training.local_batch_size", "8", *tp],
             "next ep2": [*_NEXT, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
             "next pp2": [*_NEXT, "--training.local_batch_size", "8", *pp],
             "next tp2": [*_NEXT, "--training.local_batch_size", "8", *tp],
             "dense cp2 state passing": [*_DENSE, "--training.local_batch_size", "8",
                                         "--parallelism.context_parallel_degree", "2"]}
    for name, got in zip(cases, run_cases(2, list(cases.values()), STEPS), strict=True):
        try:
            assert_matches(got, refs[name.split()[0]], 1e-5)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


_MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", "--optimizer.weight_decay_exclude"]
_F8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"]
_ULYSSES = ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ulysses"]


@pytest.mark.ranks
def test_hsdp_muon_float8_and_ulysses_cp_equal_one_process(tmp_path):
    """One 4-rank launch, each case against one process with the same settings (losses, grad norms, step-1
    gradients, final parameters; fp32): HSDP 2 x 2 (dense); Muon under FSDP 2 x TP 2 (dense) and EP 2 x FSDP 2
    (MoE): the projections (DeltaNet's wb and wa too) and experts orthogonalized, convolution taps, decay and norms
    under AdamW; Ulysses CP 2 x FSDP 2 (dense) and CP 2 x EP 2 (MoE) on packed documents: DeltaNet runs whole
    sequences of a head group per rank, its state reset per document; the same for Qwen3-Next (its dense and MoE
    blocks) under selective op AC. All-gather CP 4 (above the dense model's 2 key heads) and CP 2 x EP 2 (MoE) on
    packed documents, the DeltaNet layers by state passing (each rank its chunks, their starting state composed
    from the chunks before, reset where a document starts). Float8 (emulated, tensorwise) under FSDP 4,
    as tests/test_speed_features.py holds it: its activations' scales are each rank's own amax, so against one
    process it is within float8's rounding (and off high precision); with FSDP float8 all-gathers (weights cast
    before the gather, by the global amax) it equals the same layout without them."""
    from tests.launch import assert_matches, one_process, run_cases
    from tests.test_speed_features import LOW_PRECISION_TOL

    docs = tmp_path / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {k}: " + "ab cd " * (k % 5)}) + "\n" for k in range(400)))
    packed = ["--training.dataset", "files", "--training.dataset_path", str(docs), "--model.attn_mask_type",
              "block_causal"]
    batch = "--training.local_batch_size"
    cases = {  # name: (model and settings, this layout)
        "HSDP 2x2": (_DENSE, [batch, "2", "--parallelism.data_parallel_replicate_degree", "2"]),
        "Muon FSDP 2 x TP 2": ([*_DENSE, *_MUON], [batch, "4", "--parallelism.tensor_parallel_degree", "2"]),
        "MoE Muon EP 2 x FSDP 2": ([*_MOE, *_MUON], [batch, "2", "--parallelism.expert_parallel_degree", "2"]),
        "Float8 FSDP 4": ([*_DENSE, *_F8], [batch, "2"]),
        "Float8 FSDP 4, float8 all-gathers": ([*_DENSE, *_F8], [batch, "2", "--quantize.linear.float8."
                                                                       "enable_fsdp_float8_all_gather"]),
        "Ulysses CP 2 x FSDP 2, documents": ([*_DENSE, *packed], [batch, "4", *_ULYSSES]),
        "MoE Ulysses CP 2 x EP 2, documents": ([*_MOE, *packed], [batch, "4", *_ULYSSES,
                                                                  "--parallelism.expert_parallel_degree", "2"]),
        "state passing CP 4 (above the 2 key heads), documents": (
            [*_DENSE, *packed], [batch, "8", "--parallelism.context_parallel_degree", "4"]),
        "MoE state passing CP 2 x EP 2, documents": (
            [*_MOE, *packed], [batch, "4", "--parallelism.context_parallel_degree", "2",
                               "--parallelism.expert_parallel_degree", "2"]),
        "Qwen3-Next Ulysses CP 2 x EP 2, documents, op AC": (
            [*_NEXT, *packed, "--activation_checkpoint.mode", "selective",
             "--activation_checkpoint.selective_ac_option", "op"],
            [batch, "4", *_ULYSSES, "--parallelism.expert_parallel_degree", "2"]),
    }
    results = dict(zip(cases, run_cases(4, [[*m, *layout] for m, layout in cases.values()], STEPS),
                       strict=True))
    high = one_process([*_DENSE, batch, "8"], STEPS)["losses"]
    for name, got in results.items():
        try:
            if name.startswith("Float8"):
                assert got["losses"] != high and all(abs(a - b) < LOW_PRECISION_TOL
                                                     for a, b in zip(got["losses"], high, strict=True))
                if name != "Float8 FSDP 4":
                    assert_matches(got, results["Float8 FSDP 4"], 1e-5, what=("grads", "params"))
            else:
                assert_matches(got, one_process([*cases[name][0], batch, "8"], STEPS), 1e-5, what=("grads", "params"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.fast
@pytest.mark.parametrize(("argv", "world", "line"), [
    ([*_MOE, "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ulysses",
      "--parallelism.tensor_parallel_degree", "2"], 4,
     "parallelism.context_parallel_degree: ulysses splits qwen3_5_moe debugmodel_moe's 2 DeltaNet key heads over "
     "TP 2 x CP 2 = 4 ranks"),
    ([*_DENSE, "--parallelism.context_parallel_degree", "8", "--training.seq_len", "32"], 8,
     "parallelism.context_parallel_degree: all-gather CP 8 cuts each sequence into 16 chunks of 2 tokens, and "
     "qwen3_5 tiny's DeltaNet convolution reads the 3 before each token"),
    ([*_DENSE, "--parallelism.context_parallel_degree", "2", "--qwen3_5.kernel", "fla"], 2,
     "qwen3_5.kernel: fla's kernels do not run under all-gather CP 2: its DeltaNet layers pass states between the "
     "ranks' chunks in the chunked torch form"),
])
def test_layouts_the_hybrid_cannot_take_are_refused_before_launch(argv, world, line):
    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import parse_args

    with pytest.raises(ConfigError, match="^" + re.escape(line)):
        validate(parse_args(argv), world)
    wide_attention = dataclasses.replace(DENSE.flavors["tiny"], n_heads=8, n_kv_heads=4)  # DeltaNet's 2 key heads
    with pytest.raises(ValueError, match=r"4 does not divide the DeltaNet key heads \(2\) of tiny"):
        DENSE.check_layout(wide_attention, 4, 1, 1, "tiny")


@pytest.mark.ranks
def test_the_trainer_imports_and_exports_hf_sharded(tmp_path):
    """TP 2 with EP 2: each rank reads and writes its shards of DeltaNet's fused q/k/v and convolution (DTensors
    split by head, as FSDP splits them too) and of the experts, from a folder transformers saved (one tensor per
    expert) and from one in the released layout (fused experts); and of Qwen3-Next's projections fused per key head;
    lr 0 keeps the weights, so the export equals the transformers model exactly."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    from tests.launch import run_dist

    theirs = _theirs(tmp_path / "hf_in", True, vocab_size=300, layer_types=[L, F, L, F], num_hidden_layers=4)
    (tmp_path / "released").mkdir()
    (tmp_path / "released/config.json").write_text((tmp_path / "hf_in/config.json").read_text())
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, tmp_path / "released/model.safetensors",
              metadata={"format": "pt"})
    run = ["--model.name", "qwen3_5_moe", "--model.flavor=", "--training.steps", "1", "--optimizer.lr", "0",
           "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
           "--checkpoint.last_save_in_hf", "--training.local_batch_size", "2",
           "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]
    from tests.test_qwen3_next import ODD, _theirs as next_model

    next_in = next_model(tmp_path / "next_in", **{**ODD["sparse_step_and_mlp_only"], "vocab_size": 300})
    for name, model, cls in (("hf_in", theirs, Qwen3_5MoeForCausalLM), ("released", theirs, Qwen3_5MoeForCausalLM),
                             ("next_in", next_in, Qwen3NextForCausalLM)):
        family = ["--model.name", "qwen3_next"] if name == "next_in" else []
        run_dist(2, tmp_path / f"tp_ep_{name}", *run, *family, "--checkpoint.initial_load_path", str(tmp_path / name))
        exported = cls.from_pretrained(tmp_path / f"tp_ep_{name}/checkpoint/exports/step-1")
        for key, value in model.state_dict().items():
            torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0, msg=f"{name} {key}")
