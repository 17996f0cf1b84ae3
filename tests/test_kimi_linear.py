"""Kimi Linear (the DeepSeek group's kimi_linear family): KDA's chunked rule (a decay per key channel) against its
token-by-token recurrence and transformers' own, values and gradients, packed documents; counts against the models
built and the released size; logits / both HF directions / greedy generation (KDA's cache and MLA's) against
transformers' KimiLinearForCausalLM on configs that are no preset, in a folder transformers saved and in the
released layout; refusals. Its layouts are in tests/test_deepseek_v3.py's 4-rank launch."""

import dataclasses
import json
import re

import pytest
import torch

from tessera.models import family, hf_args, num_params
from tessera.models.common.deltanet import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from tests.hf_parity import (
    assert_cached_decoding_equals_whole,
    assert_refused,
    assert_round_trip,
    import_hf,
    initialized,
)
from tests.test_qwen3_5 import assert_chunked_equals_recurrence

KIMI = family("kimi_linear")
L, F = "linear_attention", "full_attention"


def _kda_inputs(bsz: int, seq: int, heads: int, dk: int, dv: int):
    gen = torch.Generator().manual_seed(0)
    q, k = (l2norm(torch.randn(bsz, seq, heads, dk, generator=gen)) for _ in "qk")
    v = torch.randn(bsz, seq, heads, dv, generator=gen)
    g = -torch.rand(bsz, seq, heads, dk, generator=gen) * 0.7  # a decay per key channel
    beta = torch.rand(bsz, seq, heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.fast
def test_sub_chunked_channel_decays_equal_the_pairwise_ones():
    """KDA's chunk under a decay per channel, pairs across sub-chunks of 16 factored at the later one's start (no
    [chunk, chunk, dk] tensor), equals every pair's decay materialized, within 1e-6, with document masks and
    gradients; steep decays (exp(-40) across a chunk) stay finite."""
    from tessera.models.common.deltanet import channel_decayed

    gen = torch.Generator().manual_seed(6)
    x, y = (torch.randn(2, 3, 64, 8, generator=gen, requires_grad=True) for _ in "xy")
    cum = (-torch.rand(2, 3, 64, 8, generator=gen) * 1.3).cumsum(-2).requires_grad_()
    docs = torch.tensor([[0] * 23 + [1] * 41, [0] * 64])
    mask = torch.ones(64, 64, dtype=torch.bool).tril() & (docs[:, None, :, None] == docs[:, None, None, :])
    pairwise = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~mask[..., None], float("-inf")).exp()
    want = torch.einsum("...id,...jd,...ijd->...ij", x, y, pairwise)
    got = channel_decayed(x, y, cum, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(got, generator=gen)
    for a, b in zip(torch.autograd.grad(got, (x, y, cum), grad), torch.autograd.grad(want, (x, y, cum), grad),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [1, 5, 16, 32, 64])
def test_the_channel_gated_rule_equals_its_recurrence_and_transformers_values_and_gradients(chunk):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    inputs = _kda_inputs(2, 37, 3, 8, 6)
    assert_chunked_equals_recurrence(inputs, chunk)
    state = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(3))
    theirs, their_state = chunk_kimi_delta_attention(*inputs, chunk_size=16, initial_state=state,
                                                     output_final_state=True)
    ours, our_state = chunk_gated_delta_rule(*inputs, chunk_size=chunk, state=state)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_state, their_state, rtol=1e-5, atol=1e-5)
    # the second document alone, from a zero state, is what the packed rows computed for it
    alone, _ = recurrent_gated_delta_rule(*(x[:1, 10:30] for x in inputs))
    documents = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [5] * 37])
    packed, _ = chunk_gated_delta_rule(*inputs, chunk_size=chunk, documents=documents)
    torch.testing.assert_close(packed[:1, 10:30], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_counts_equal_the_models_built_and_the_released_size():
    for args in KIMI.flavors.values():
        with torch.device("meta"):
            model = KIMI.spec().model(dataclasses.replace(args, vocab_size=args.vocab_size or 256))
        assert KIMI.counts(model.args, 128).params == num_params(model)
    released = KIMI.counts(KIMI.flavors["48B-A3B"], 4096)
    assert 48e9 < released.params < 50e9 and 2.5e9 < released.active - released.embedding < 3.5e9  # "48B-A3B"
    short, long = (KIMI.counts(KIMI.flavors["48B-A3B"], s).flops_per_token for s in (4096, 8192))
    mla = sum(not KIMI.flavors["48B-A3B"].linear(i) for i in range(27))  # only MLA's FLOPs grow with the sequence
    a = KIMI.flavors["48B-A3B"]
    assert mla == 7 and long - short == 6 * mla * a.n_heads * (a.head_dim + a.v_head_dim) * 4096


ODD = {  # transformers' KimiLinearConfig fields; none is a preset
    "plain_query_first_dense": dict(layer_types=[L, F, L, F], mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    "query_bottleneck_grouped_routing": dict(
        layer_types=[F, L, L, L], mlp_layer_types=["dense", "dense", "sparse", "sparse"], q_lora_rank=24,
        linear_num_heads=6, linear_head_dim=8, linear_conv_kernel_dim=3, n_group=2, topk_group=1, num_local_experts=6,
        norm_topk_prob=False, routed_scaling_factor=1.7),
}


def _theirs(path, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.KimiLinearConfig(**{**dict(
        vocab_size=97, hidden_size=48, intermediate_size=56, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        linear_num_heads=4, linear_head_dim=12, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        rms_norm_eps=1e-5), **overrides})
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1 and the routing bias at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(ODD))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **ODD[case])
    ours, args = import_hf("kimi_linear", tmp_path / "in", 80)
    assert all(args.arch() != f.arch() for f in KIMI.flavors.values())
    assert KIMI.counts(args, 32).params == num_params(ours)
    assert args.layer_types == ODD[case]["layer_types"]
    for module in ours.modules():  # several chunks in 80 tokens (transformers' is 64)
        if hasattr(module, "chunk_size"):
            module.chunk_size = 16
    tokens = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    assert_round_trip(theirs, ours, args, transformers.KimiLinearForCausalLM, tmp_path / "in", tmp_path)


def test_the_released_layout_loads_and_gates_it_does_not_compute_are_refused(tmp_path):
    """The release's config.json (linear_attn_config with its MLA blocks counted from 1, Kimi's MoE names) and its
    dense block's SwiGLU under mlp. load to transformers' logits; K3-style gates and an MoE pattern that is not
    dense-first are refused in one line naming the file; our export reloads in transformers."""
    from safetensors.torch import load_file, save_file

    theirs = _theirs(tmp_path / "hf", **ODD["plain_query_first_dense"])
    released = tmp_path / "released"
    released.mkdir()
    config = json.loads((tmp_path / "hf/config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        config.pop(key)
    config.update(first_k_dense_replace=1, mla_use_nope=True, linear_attn_config={
        "full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 4, "head_dim": 12, "short_conv_kernel_size": 4})
    (released / "config.json").write_text(json.dumps(config))
    state = load_file(tmp_path / "hf/model.safetensors")
    dense = {k: k.replace(".block_sparse_moe.", ".mlp.") for k in state
             if re.fullmatch(r"model\.layers\.0\.block_sparse_moe\.\w+_proj\.weight", k)}
    assert len(dense) == 3
    save_file({dense.get(k, k): v for k, v in state.items()}, released / "model.safetensors", metadata={"format": "pt"})
    ours, _ = import_hf("kimi_linear", released)
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    for bad, line in (({"linear_attn_config": {**config["linear_attn_config"], "gate_lower_bound": -5.0}},
                       "gate_lower_bound = -5.0: Tessera's kimi_linear computes transformers' Kimi Linear"),
                      ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]},
                       "mlp_layer_types = ['sparse', 'dense', 'sparse', 'sparse']: Tessera builds the dense blocks "
                       "first"),
                      ({"linear_attn_config": {**config["linear_attn_config"], "full_attn_layers": [0, 4]}},
                       "linear_attn_config.full_attn_layers = [0, 4]: MLA blocks counted from 1 to 4")):
        (released / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ValueError, match="^" + re.escape(f"{released / 'config.json'}: {line}")):
            hf_args("kimi_linear", str(released))


@pytest.mark.fast
def test_cached_decoding_equals_the_uncached_path():
    """KDA's cache (convolution inputs and state) and MLA's: a prefill then a token at a time gives the logits of
    the whole sequence."""
    model = initialized(KIMI, dataclasses.replace(KIMI.flavors["debugmodel"], vocab_size=60, max_seq_len=40)).eval()
    for module in model.modules():
        if hasattr(module, "chunk_size"):
            module.chunk_size = 8
    assert_cached_decoding_equals_whole(model, 60)


@pytest.mark.fast
@pytest.mark.parametrize(("argv", "world", "line"), [
    (["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ulysses",
      "--parallelism.tensor_parallel_degree", "4"], 8,
     "parallelism.context_parallel_degree: ulysses splits kimi_linear debugmodel's 4 KDA key heads over TP 4 x CP 2 "
     "= 8 ranks"),
    (["--parallelism.context_parallel_degree", "8", "--training.seq_len", "32"], 8,
     "parallelism.context_parallel_degree: all-gather CP 8 cuts each sequence into 16 chunks of 2 tokens, and "
     "kimi_linear debugmodel's KDA convolution reads the 3 before each token"),
])
def test_layouts_and_settings_it_cannot_take_are_refused_before_launch(argv, world, line):
    assert_refused("kimi_linear", argv, world, line)
    with pytest.raises(ValueError, match=r"4 does not divide the KDA heads \(6\) of odd"):
        KIMI.check_layout(dataclasses.replace(KIMI.flavors["debugmodel"], linear_heads=6), 4, 1, 1, "odd")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()


def state_passing_errors(case, steps) -> dict[str, float]:
    """On each of 2 ranks (on_ranks' target): the largest difference (relative to the largest value) between a
    linear-attention mixer (Gated DeltaNet, KDA) on the whole sequence and under all-gather CP by state passing
    (tessera.parallel.cp.StatePassing) on this rank's chunks, outputs and input gradients, for packed documents
    whose starts fall on the CP chunks' starts (4 chunks of 8), inside them, or nowhere."""
    import torch.distributed as dist

    from tessera.models.common.deltanet import GatedDeltaNet
    from tessera.models.deepseek.kimi_linear.model import KimiDeltaAttention
    from tessera.parallel.cp import StatePassing, WholeDocuments, shard_sequence

    if not dist.is_initialized():  # a fresh pool's ranks (a training job initializes it and keeps it)
        dist.init_process_group("gloo")
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    errors = {}
    for name, mixer in (("Gated DeltaNet", GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6)),
                        ("KDA", KimiDeltaAttention(32, 4, 8, 4, 1e-5))):
        for p in mixer.parameters():
            torch.nn.init.normal_(p, 0, 0.3)
        mixer.chunk_size = 4
        whole = torch.randn(2, 32, 32)
        for lengths in ([8, 8, 16], [16, 16], [5, 3, 9, 15], [1, 7, 8, 1, 15], [32]):
            docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].expand(2, -1)
            x = whole.clone().requires_grad_()
            want = mixer(x, documents=docs)
            (want * torch.cos(want)).sum().backward()
            plain, mine = mixer.rule, shard_sequence(whole, rank, cp).requires_grad_()
            mixer.rule = StatePassing(group, rank, cp, plain, WholeDocuments(group, cp))
            got = mixer(mine, documents=shard_sequence(docs, rank, cp))
            (got * torch.cos(got)).sum().backward()
            mixer.rule = plain
            errors[f"{name} {lengths}"] = max(_relative(got, shard_sequence(want, rank, cp)),
                                              _relative(mine.grad, shard_sequence(x.grad, rank, cp)))
    return errors


@pytest.mark.ranks
def test_state_passing_equals_the_whole_sequence_where_documents_start_on_chunk_starts():
    """A document starting exactly where a CP chunk starts, and running on into the next chunk, starts from nothing
    there also for the chunks after it (each composes the chunks before it)."""
    from tests.launch import on_ranks

    (errors,) = on_ranks(2, "tests.test_kimi_linear:state_passing_errors", [None], 0)
    assert len(errors) == 10 and max(errors.values()) < 1e-5, errors


@pytest.mark.ranks
def test_the_trainer_imports_and_exports_hf_sharded(tmp_path):
    """TP 2 with EP 2: each rank reads and writes its shards of KDA's per-head parameters (A as [1, 1, heads, 1],
    the convolutions [channels, 1, K], split by head) and of the experts, from a folder transformers saved; lr 0
    keeps the weights, so the export equals the transformers model exactly."""
    from transformers import KimiLinearForCausalLM

    from tests.launch import run_dist

    theirs = _theirs(tmp_path / "hf_in", **{**ODD["plain_query_first_dense"], "vocab_size": 300})
    run_dist(2, tmp_path / "tp_ep", "--model.name", "kimi_linear", "--model.flavor=", "--training.steps", "1",
             "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable",
             "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf", "--training.local_batch_size", "2",
             "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
             "--moe.load_balance_rate", "0", "--checkpoint.initial_load_path", str(tmp_path / "hf_in"))
    exported = KimiLinearForCausalLM.from_pretrained(tmp_path / "tp_ep/checkpoint/exports/step-1")
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0, msg=key)
