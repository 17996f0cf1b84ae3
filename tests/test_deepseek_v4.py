"""DeepSeek V4 (the DeepSeek group's deepseek_v4 family): counts against the models built and the released sizes;
logits / both HF directions / greedy generation against transformers' DeepseekV4ForCausalLM on configs that are no
preset (sliding, CSA and HCA blocks, hash routing, YaRN), in a folder transformers saved and in the release's
layout and config names; packed documents; the indexer's loss; refusals. Its layouts are in
tests/test_deepseek_v3.py's 4-rank launch."""

import dataclasses
import json
import re

import pytest
import torch

from tessera.models import family, hf_args, num_params
from tests.hf_parity import (
    assert_cached_decoding_equals_whole,
    assert_refused,
    assert_round_trip,
    assert_steps_do_not_recompile,
    import_hf,
    initialized,
)

V4 = family("deepseek_v4")
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@pytest.mark.fast
def test_counts_equal_the_models_built_and_the_released_sizes():
    for args in V4.flavors.values():
        with torch.device("meta"):
            model = V4.spec().model(dataclasses.replace(args, vocab_size=args.vocab_size or 256))
        assert V4.counts(model.args, 128).params == num_params(model)
    flash, pro = (V4.counts(dataclasses.replace(V4.flavors[f], n_mtp=0), 4096) for f in ("Flash", "Pro"))
    assert 280e9 < flash.params < 290e9 and 12e9 < flash.active < 14e9  # "284B, 13B active"
    assert 1.55e12 < pro.params < 1.65e12 and 47e9 < pro.active < 51e9  # "1.6T, 49B active"
    # the attention's FLOPs grow with the compressed entries a query attends, not with the sequence squared
    a = V4.flavors["Flash"]
    short, long = (V4.counts(a, s).flops_per_token for s in (65536, 131072))
    dense_growth = 6 * a.n_layers * a.n_heads * 2 * a.head_dim * 65536
    assert 0 < long - short < dense_growth / 20


ODD = {  # transformers' DeepseekV4Config fields; none is a preset
    "all_three_kinds_hash_first": dict(
        layer_types=[S, C, H], mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={C: 4, H: 8}, sliding_window=6, hc_mult=2, index_topk=3),
    "yarn_sigmoid_three_streams": dict(
        layer_types=[H, C, S, C], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], num_hidden_layers=4,
        compress_rates={C: 2, H: 16}, sliding_window=5, hc_mult=3, hc_sinkhorn_iters=7, o_groups=4, index_topk=5,
        scoring_func="sigmoid", routed_scaling_factor=2.0, partial_rotary_factor=0.25,
        swiglu_limit=0.7, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                           "beta_fast": 8, "beta_slow": 1}),
}


def _theirs(path, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV4Config(**{**dict(
        vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, hc_sinkhorn_iters=5, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8,
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None), **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    # 8 indexer heads: an entry scores exactly 0 (the relu's) only where all do, so ties at the top-k's edge, which
    # topk and our stable pick break differently, are rare
    with torch.no_grad():  # sinks, slot biases and the streams' biases start at 0, the routing table at expert 0
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], config.n_routed_experts).topk(b.shape[1]).indices)
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(ODD))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, case):
    """A folder transformers saved (the release's names under `model.`) imports to its logits; our export (the
    release's names) reloads in transformers with them; greedy generation (our decoding cache) equals theirs."""
    transformers = pytest.importorskip("transformers")
    theirs = _theirs(tmp_path / "in", **ODD[case])
    ours, args = import_hf("deepseek_v4", tmp_path / "in", 64)
    assert all(args.arch() != f.arch() for f in V4.flavors.values())
    assert V4.counts(args, 32).params == num_params(ours)
    assert args.layer_types == ODD[case]["layer_types"]
    tokens = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    assert_round_trip(theirs, ours, args, transformers.DeepseekV4ForCausalLM, tmp_path / "in", tmp_path)


def test_the_released_layout_and_config_names_load_and_what_it_does_not_compute_is_refused(tmp_path):
    """The release's tensor names (no `model.` prefix, `embed`, `hc_head_fn`, MTP depths beside) and its older
    config names (compress_ratios, compress_rate_csa / _hca, num_hash_layers, qk_rope_head_dim) load to
    transformers' logits; settings transformers computes otherwise are refused in one line naming the file."""
    from safetensors.torch import load_file, save_file

    theirs = _theirs(tmp_path / "hf", **ODD["all_three_kinds_hash_first"])
    released = tmp_path / "released"
    released.mkdir()
    config = json.loads((tmp_path / "hf/config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor"):
        config.pop(key)
    config.update(compress_ratios=[0, 4, 8], compress_rate_csa=4, compress_rate_hca=8, num_hash_layers=1,
                  qk_rope_head_dim=8)
    (released / "config.json").write_text(json.dumps(config))
    renames = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    saved = load_file(tmp_path / "hf/model.safetensors")
    state = {renames.get(k, k.removeprefix("model.")): v for k, v in saved.items()}
    state["mtp.0.emb.tok_emb.weight"] = torch.zeros(97, 32)  # a depth transformers does not build either
    save_file(state, released / "model.safetensors", metadata={"format": "pt"})
    ours, args = import_hf("deepseek_v4", released)
    assert args.layer_types == [S, C, H] and args.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert args.rope_head_dim == 8 and (args.csa_rate, args.hca_rate) == (4, 8)
    tokens = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    for bad, line in (({"num_key_value_heads": 2}, "num_key_value_heads = 2: Tessera's deepseek_v4 computes"),
                      ({"compress_ratios": [0, 4, 16]}, "compress_ratios holds [16]: each must be 0, the CSA rate 4 "
                                                        "or the HCA rate 8"),
                      ({"n_shared_experts": 2}, "n_shared_experts = 2: Tessera's deepseek_v4 computes")):
        (released / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ValueError, match="^" + re.escape(f"{released / 'config.json'}: {line}")):
            hf_args("deepseek_v4", str(released))


def _debug(**changes):
    return initialized(V4, dataclasses.replace(V4.flavors["debugmodel"], vocab_size=60, max_seq_len=64, **changes))


@pytest.mark.fast
def test_packed_documents_equal_each_document_alone():
    """Block-causal masking: packed after another whose length is a multiple of the rates (8), a document's logits
    (its positions from 0) equal its own, compressed entries included (CSA's reach back stops at its start). After
    one that is not (13), its logits do not depend on the document before."""
    from tessera.models.common.rope import document_positions

    model = _debug().eval()
    first, second = (torch.randint(0, 60, (1, n), generator=torch.Generator().manual_seed(n)) for n in (13, 48))

    def packed(a, b):
        documents = torch.tensor([[0] * a.shape[1] + [1] * b.shape[1]])
        return model(torch.cat([a, b], dim=1), documents=documents, positions=document_positions(documents)[0])

    with torch.no_grad():
        together = packed(first[:, :8], second)
        torch.testing.assert_close(together[:, :8], model(first[:, :8]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[:, 8:], model(second), rtol=1e-5, atol=1e-5)
        after, after_other = packed(first, second[:, :43]), packed(first.flip(1), second[:, :43])
    torch.testing.assert_close(after[:, :13], model(first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[:, 13:], after_other[:, 13:], rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_the_indexer_learns_from_its_own_loss_only():
    """The CSA indexers' KL loss trains them alone (their inputs detached): the other gradients are those of the
    language-model loss, the indexers get none at weight 0."""
    model = _debug().train()
    tokens = torch.randint(0, 60, (2, 32), generator=torch.Generator().manual_seed(3))
    losses = [m for m in model.modules() if getattr(m, "metric", None) == "indexer_loss"]
    assert [m.metric for m in losses] == ["indexer_loss", "indexer_loss"]  # the two CSA blocks
    grads = {}
    for weight in (0.0, 1.0):
        for m in losses:
            m.weight = weight
        model.zero_grad()
        model(tokens, labels=tokens).backward()
        grads[weight] = {n: p.grad for n, p in model.named_parameters()}
    indexer = [n for n in grads[1.0] if ".indexer." in n]
    assert indexer and all(grads[0.0][n] is None for n in indexer)
    assert all(grads[1.0][n] is not None and grads[1.0][n].abs().sum() > 0 for n in indexer if "wq_b" in n)
    for n, g in grads[0.0].items():
        if g is not None:
            torch.testing.assert_close(grads[1.0][n], g, rtol=1e-6, atol=1e-7)


@pytest.mark.fast
@pytest.mark.parametrize("kind", [S, C, H])
@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
def test_each_attention_kind_equals_the_materialized_reference(kind, packed, monkeypatch):
    """Each block kind as computed now (the window and the entries in the blockwise attention kernel, CSA's top-k
    and KL a block of queries at a time) equals the path it replaced, which materialized the entries' scores:
    output, indexer loss and every weight's gradient within 1e-5, on whole and packed sequences."""
    from tessera.models.common import blockwise
    from tests.sparse_reference import v4_layer_reference

    monkeypatch.setattr(blockwise, "SCORES_PER_BLOCK", 1024)  # many blocks of queries and keys at this size
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 16)
    model = _debug(layer_types=[kind] * 4).train()
    attn = model.layers["0"].attention
    if kind == C:
        attn.indexer_loss.weight, attn.indexer_loss.values = 1.0, []
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 61, model.args.dim, generator=gen)
    docs = torch.tensor([[0] * 24 + [1] * 37, [0] * 45 + [1] * 16]) if packed else None
    rope = model.rope[:61]
    out = attn(x, rope, documents=docs)
    want, kl = v4_layer_reference(attn, x, rope, docs)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out, generator=gen)
    weights = list(attn.parameters())
    ours = torch.autograd.grad((out * grad).sum(), weights, allow_unused=True)
    theirs = torch.autograd.grad((want * grad).sum() + (kl if kl is not None else 0), weights, allow_unused=True)
    for (name, _), a, b in zip(attn.named_parameters(), ours, theirs, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    if kl is not None:
        assert float(attn.indexer_loss.values[0]) == pytest.approx(float(kl.detach()), rel=1e-5, abs=1e-7)


@pytest.mark.fast
def test_cached_decoding_equals_the_uncached_path():
    assert_cached_decoding_equals_whole(_debug().eval(), 60)


@pytest.mark.fast
@pytest.mark.parametrize(("argv", "world", "line"), [
    (["--parallelism.context_parallel_degree", "4", "--training.seq_len", "48"], 4,
     "parallelism.context_parallel_degree: all-gather CP 4 cuts each sequence into 8 chunks of 6 tokens, and "
     "deepseek_v4 debugmodel's chunks must hold its window (8 tokens) and whole windows of its compression rates "
     "[4, 8]; set training.seq_len to a multiple of 64 of at least 64, or lower the CP degree"),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ulysses"], 2,
     "parallelism.context_parallel_method: deepseek_v4 debugmodel's one key/value head serves every query head"),
    (["--parallelism.tensor_parallel_degree", "4"], 4,
     "parallelism.tensor_parallel_degree: 4 does not divide the output projection's groups (2)"),
    (["--lora.rank", "4", "--lora.target_modules", "wq_b,wo_a"], 1,
     "lora.target_modules: wo_a is deepseek_v4 debugmodel's grouped output projection"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.0"], 2,
     "parallelism.pipeline_parallel_degree: deepseek_v4 debugmodel's hash-routed blocks [0] read the token ids, "
     "which only the first stage holds, and it holds blocks []"),
])
def test_layouts_and_settings_it_cannot_take_are_refused_before_launch(argv, world, line):
    assert_refused("deepseek_v4", argv, world, line)


@pytest.mark.fast
def test_short_sequences_run_with_a_line_saying_what_they_change(caplog):
    """A smoke run's short sequence is no error: a top-k above the entries, or a length the rates do not divide (its
    last tokens make no entry), each runs with a warning line."""
    from tessera.preflight import validate
    from tessera.schema import parse_args

    validate(parse_args(["--model.name", "deepseek_v4", "--model.flavor", "debugmodel", "--training.seq_len", "36"]),
             1)
    assert "training.seq_len: 36 tokens make 9 CSA entries, and deepseek_v4 debugmodel attends the top 4" not in \
        caplog.text
    assert "training.seq_len: 36 tokens is not a multiple of deepseek_v4 debugmodel's compression rates [4, 8]" in \
        caplog.text
    validate(parse_args(["--model.name", "deepseek_v4", "--model.flavor", "debugmodel", "--training.seq_len", "16"]),
             1)
    assert "training.seq_len: 16 tokens make 4 CSA entries, and deepseek_v4 debugmodel attends the top 4" in caplog.text


def test_compiled_blocks_compile_once_per_kind_of_block_not_per_step():
    """Each block compiled (dynamo, eager backend): the first step compiles a graph per kind of block (sliding, CSA,
    HCA; hash-routed or not), the second recompiles nothing. (The attention, the indexer's top-k and its loss are
    custom ops: a CSA block breaks no graph where they run.)"""
    tokens = torch.randint(0, 60, (2, 32), generator=torch.Generator().manual_seed(1))
    assert_steps_do_not_recompile(_debug().train(), lambda m: m(tokens, labels=tokens), 2, {1})


@pytest.mark.ranks
def test_the_trainer_imports_and_exports_hf_under_pp_and_ep(tmp_path):
    """PP 2 x EP 2 from a transformers folder, one step at lr 0 (and no bias update): the export (written by the ranks
    that hold each tensor; the hash-routing table, integers, gathered from the first stage's) reloads in transformers
    equal to the folder, routing table and experts included."""
    from transformers import DeepseekV4ForCausalLM

    from tests.launch import run_dist

    theirs = _theirs(tmp_path / "hf_in", vocab_size=300, num_hidden_layers=4, layer_types=[S, C, H, C],
                     mlp_layer_types=["hash_moe", "moe", "moe", "moe"], compress_rates={C: 4, H: 8}, sliding_window=6,
                     hc_mult=2, index_topk=3)
    run_dist(4, tmp_path / "run", "--model.name", "deepseek_v4", "--model.flavor=", "--training.steps", "1",
             "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "0", "--moe.load_balance_rate", "0",
             "--checkpoint.enable",
             "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf", "--checkpoint.initial_load_path",
             str(tmp_path / "hf_in"), "--training.local_batch_size", "2", "--training.seq_len", "32",
             "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
             "--parallelism.expert_parallel_degree", "2")
    exported = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "run/checkpoint/exports/step-1").state_dict()
    for key, value in theirs.state_dict().items():
        if "rotary_emb" not in key:
            torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


def _mtp_model():
    """debugmodel_mtp (two depths: a CSA block, then a sliding one), its mixing weights and norms perturbed."""
    model = initialized(V4, dataclasses.replace(V4.flavors["debugmodel_mtp"], vocab_size=60, max_seq_len=64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".base", ".scale", "norm.weight")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model


def _reference_depths(model, tokens) -> list[torch.Tensor]:
    """The MTP depths written from the release's equations (its MTPBlock; its code, with GPU kernels, is not ours to
    copy): depth k at slots 0..S-k-1 takes the previous depth's streams there (the trunk's before hc_head first) and
    the tokens k..S-1: e = enorm(embed(token)); each stream hnorm'd and h_proj'd, e_proj(e) added to each; the block;
    its own hc_head (sigmoid(rms(streams) fn x scale + base) + eps weighting the streams) and norm; the shared head."""
    a, out = model.args, []
    streams = model.hidden(tokens)
    for k, depth in enumerate(model.mtp.values(), 1):
        n = tokens.shape[1] - k
        e = torch.nn.functional.rms_norm(model.tok_embeddings(tokens[:, k:]), (a.dim,), depth.enorm.weight, a.norm_eps)
        h = torch.nn.functional.rms_norm(streams[:, :n].unflatten(-1, (a.hc_mult, a.dim)), (a.dim,),
                                         depth.hnorm.weight, a.norm_eps)
        x = (h @ depth.h_proj.weight.T + (e @ depth.e_proj.weight.T).unsqueeze(2)).flatten(2)
        streams = depth.block(x, model.rope)
        flat = streams * torch.rsqrt(streams.square().mean(-1, keepdim=True) + a.norm_eps)
        pre = torch.sigmoid(flat @ depth.hc_head.fn.T * depth.hc_head.scale + depth.hc_head.base) + a.hc_eps
        collapsed = (pre.unsqueeze(-1) * streams.unflatten(-1, (a.hc_mult, a.dim))).sum(2)
        out.append(model.head(torch.nn.functional.rms_norm(collapsed, (a.dim,), depth.norm.weight, a.norm_eps)))
    return out


def test_mtp_depths_equal_the_release_equations_and_respect_packed_documents():
    """Each depth's logits equal the reference above; a document packed after another gets the depths' logits it gets
    alone (the tokens, positions and documents read ahead are its own)."""
    from tessera.models.common.rope import document_positions

    model = _mtp_model().eval()
    tokens = torch.randint(0, 60, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.mtp_logits(model.hidden(tokens), tokens)
        for k, (ours, want) in enumerate(zip(got, _reference_depths(model, tokens), strict=True), 1):
            assert ours.shape == (2, 32 - k, 60)
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
        documents = torch.tensor([[0] * 8 + [1] * 24])
        positions = document_positions(documents)[0]
        packed = torch.cat([tokens[:1, :8], tokens[1:, :24]], dim=1)
        together = model.mtp_logits(model.hidden(packed, documents=documents, positions=positions), packed, documents,
                                    positions)
        alone = model.mtp_logits(model.hidden(tokens[1:, :24]), tokens[1:, :24])
    for t, a in zip(together, alone, strict=True):
        torch.testing.assert_close(t[:, 8:], a, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_the_mtp_loss_is_the_weighted_mean_of_the_depths_cross_entropies_and_trains_the_depths():
    """Computed by hand from mtp_logits, within 1e-5; both depths get gradients."""
    model = _mtp_model().train()
    tokens = torch.randint(0, 60, (2, 32), generator=torch.Generator().manual_seed(5))
    model.mtp_loss.weight = 0.3
    model(tokens).mean().backward()  # without labels: depth k's targets are the tokens k + 1 on
    with torch.no_grad():
        depths = [torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), tokens[:, k + 1:].flatten())
                  for k, out in enumerate(model.mtp_logits(model.hidden(tokens), tokens), 1)]
    torch.testing.assert_close(model.mtp_loss.total, torch.stack(depths).mean(), rtol=1e-5, atol=1e-6)
    assert all(model.mtp[k].e_proj.weight.grad.abs().sum() > 0 for k in ("0", "1"))
