"""DeepSeek V3.2's and GLM-5's sparse attention (DSA) in the DeepSeek V3 family: logits, both HF directions and greedy
generation (the indexer's keys cached) against transformers' DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM (its
indexer's RoPE in pairs, blocks sharing an earlier block's selection) on configs that are no preset,
with the top-k below the sequence so that attention is sparse; the indexer's training (its KL loss reaches the
indexer alone, the main model only the language-model loss; the dense warm-up attends every key); counts; bad
settings refused in one line. Its layouts are in tests/test_deepseek_v3.py's 4-rank launch."""

import dataclasses

import pytest
import torch

from tessera.models import family, num_params
from tests.hf_parity import assert_round_trip, assert_steps_do_not_recompile, import_hf, initialized

DSV3 = family("deepseek_v3")
V32 = {  # transformers' DeepseekV32Config fields; none is a preset
    "yarn_topk5": dict(index_topk=5, index_n_heads=3, index_head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "mlp_layer_types_topk9": dict(index_topk=9, index_n_heads=2, index_head_dim=12, n_group=1, topk_group=1,
                                  mlp_layer_types=["dense", "dense", "sparse"]),
}


GLM5 = {  # transformers' GlmMoeDsaConfig fields; none is a preset
    "shared_blocks": dict(num_hidden_layers=4, rms_norm_eps=1e-5, n_group=1, topk_group=1, index_topk=5,
                          index_n_heads=3, index_head_dim=16, indexer_types=["full", "shared", "full", "shared"]),
}


def _theirs(path, glm: bool = False, **overrides):
    transformers = pytest.importorskip("transformers")
    config = (transformers.GlmMoeDsaConfig if glm else transformers.DeepseekV32Config)(**{
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "vocab_size": 97, "max_position_embeddings": 64, "bos_token_id": None,
        "eos_token_id": None, "attn_implementation": "eager", **overrides})
    torch.manual_seed(0)
    model = (transformers.GlmMoeDsaForCausalLM if glm else transformers.DeepseekV32ForCausalLM)(config).eval()
    with torch.no_grad():  # the router, its bias and the norms made to count
        for name, p in model.named_parameters():
            if "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", [*sorted(V32), *sorted(GLM5)])
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    glm = case in GLM5
    theirs = _theirs(tmp_path / "in", glm, **(GLM5 if glm else V32)[case])
    ours, args = import_hf("deepseek_v3", tmp_path / "in")
    assert args.index_topk == 5 if glm else V32[case]["index_topk"]
    assert (args.index_rope_interleave, args.index_shared) == ((True, [1, 3]) if glm else (False, []))
    assert DSV3.counts(args, 32).params == num_params(ours)
    assert all(args.arch() != f.arch() for f in DSV3.flavors.values())
    cls = transformers.GlmMoeDsaForCausalLM if glm else transformers.DeepseekV32ForCausalLM
    assert_round_trip(theirs, ours, args, cls, tmp_path / "in", tmp_path)


def _model(topk: int = 6):
    args = dataclasses.replace(DSV3.flavors["v32_debugmodel"], vocab_size=64, max_seq_len=32, index_topk=topk)
    return initialized(DSV3, args).train()


def _indexer(name: str) -> bool:
    return ".indexer." in name


@pytest.mark.fast
def test_the_indexer_loss_trains_the_indexer_alone_and_the_warmup_attends_every_key():
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = {}
    for weight in (0.0, 1.0):
        model = _model()
        for side in (m for m in model.modules() if m.__class__.__name__ == "SideLoss" and m.metric == "indexer_loss"):
            side.weight = weight
        model(tokens).float().logsumexp(-1).mean().backward()
        grads[weight] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads[1.0].items():
        if _indexer(name):
            assert grads[0.0][name] is None and grad is not None and grad.abs().sum() > 0, name
        elif grad is not None:
            torch.testing.assert_close(grad, grads[0.0][name], rtol=0, atol=0, msg=name)
    warm, dense = _model(), _model(topk=32)  # during the warm-up every key, as a top-k of all of them
    warm.attend_every_key(True)
    with torch.no_grad():
        torch.testing.assert_close(warm(tokens), dense(tokens))
        assert not torch.allclose(_model()(tokens), dense(tokens))  # after it, sparse


def _sparse_inputs(model, block: str, tokens, documents=None):
    """The inputs block `block`'s sparse attention gets in a forward of `model` (its sparse core's arguments), as
    leaves that take gradients."""
    layer = model.layers[block].attention
    seen = []
    hook = layer.sparse_core.register_forward_pre_hook(lambda _, args: seen.append(args))
    with torch.no_grad():
        model(tokens, documents=documents)
    hook.remove()
    _, x, q_latent, rope, q, k, v, _, docs = seen[0]
    return layer, [t.detach().requires_grad_() for t in (x, q_latent, q, k, v)], rope, docs


@pytest.mark.fast
@pytest.mark.parametrize("case", ["sparse", "sparse_packed", "warmup", "warmup_packed", "glm5_shared"])
def test_sparse_attention_and_the_indexer_loss_equal_the_materialized_reference(case, monkeypatch):
    """DSA as computed now (the top-k a block of queries at a time, the main attention over the selected keys in
    the attention kernel, the KL a block at a time with its gradients) equals the materialized path it replaced
    (scores over every key): output, indexer loss and the gradients of q, k, v and every indexer weight within
    1e-5, sparse, in the dense warm-up, on packed documents, and in a GLM-5 block that reads an earlier one's
    picks."""
    from tessera.models.common import blockwise
    from tests.sparse_reference import dsa_reference

    monkeypatch.setattr(blockwise, "SCORES_PER_BLOCK", 1024)  # many blocks of queries and keys at this size
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 16)
    flavor, block = ("glm5_debugmodel", "2") if case == "glm5_shared" else ("v32_debugmodel", "1")
    args = dataclasses.replace(DSV3.flavors[flavor], vocab_size=64, max_seq_len=40, index_topk=7)
    model = initialized(DSV3, args).train()
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 64, (2, 40), generator=gen)
    documents = torch.tensor([[0] * 13 + [1] * 27, [0] * 30 + [1] * 10]) if "packed" in case else None
    layer, (x, q_latent, q, k, v), rope, docs = _sparse_inputs(model, block, tokens, documents)
    picked = None
    if layer.indexer is None:  # GLM-5's shared block: the picks of the block before, as a mask
        index = layer.selections.before(int(block))
        picked = torch.zeros(*index.shape[:2], 41, dtype=torch.bool).scatter(-1, index.where(index >= 0, 40),
                                                                              True)[..., :40]
    else:
        layer.indexer_loss.weight, layer.indexer_loss.values = 1.0, []
        model.attend_every_key("warmup" in case)
    out = layer.sparse_core(layer.parts(), x, q_latent, rope, q, k, v, None, docs)
    want, kl, _ = dsa_reference(layer, x, q_latent, rope, q, k, v, docs, "warmup" in case, picked)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    weights = [q, k, v, *(layer.indexer.parameters() if layer.indexer is not None else ())]
    grad = torch.randn_like(out, generator=gen)
    ours = torch.autograd.grad((out * grad).sum(), weights)
    theirs = torch.autograd.grad((want * grad).sum() + (kl if kl is not None else 0), weights)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if kl is not None:
        assert float(layer.indexer_loss.values[0]) == pytest.approx(float(kl.detach()), rel=1e-5, abs=1e-7) and kl > 0
        assert any(g.abs().sum() > 0 for g in ours[3:])


@pytest.mark.fast
def test_counts_have_the_indexer_and_top_k_attention():
    sparse, dense = DSV3.flavors["v32_671B"], DSV3.flavors["671B"]
    stored = DSV3.counts(sparse, 4096).params + 2 * sparse.vocab_size * sparse.dim  # the MTP layer's copies too
    assert 684e9 < stored < 686e9  # V3.2-Exp's 685B
    glm = DSV3.counts(DSV3.flavors["glm5"], 4096)
    assert 743e9 < glm.params < 745e9 and 40e9 < glm.active - glm.embedding < 41e9  # GLM-5: 744B, 40B active
    long = [DSV3.counts(a, 131072).flops_per_token for a in (sparse, dense)]
    assert long[0] < 0.3 * long[1]  # attention over 2048 keys, not 131072


@pytest.mark.fast
@pytest.mark.parametrize("argv, line", [
    (["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ulysses"],
     "parallelism.context_parallel_method: deepseek_v3 v32_debugmodel's sparse attention \\(DSA\\) picks each "
     "query's keys with an indexer of one head"),
    (["--model.flavor", "glm5_debugmodel", "--parallelism.pipeline_parallel_degree", "2"],
     "parallelism.pipeline_parallel_degree: deepseek_v3 glm5_debugmodel's blocks \\[2\\] attend the keys an earlier "
     "block picked, which may sit on another stage"),
])
def test_settings_dsa_cannot_take_are_refused_in_one_line(argv, line):
    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import parse_args

    with pytest.raises(ConfigError, match="^" + line):
        flavor = [] if "--model.flavor" in argv else ["--model.flavor", "v32_debugmodel"]
        validate(parse_args(["--model.name", "deepseek_v3", *flavor, *argv]), 2)


def test_a_run_logs_the_indexer_loss_and_the_warmup_changes_what_it_trains(tmp_path, caplog):
    """One process, 4 steps: the indexer's KL loss in every logged step; 2 dense warm-up steps train another model
    than none (the attention differs from step 1). Resuming with other [deepseek_v3] options applies them, one line
    each."""
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tests.dist_worker import BASE, run_train
    from tests.launch import merge

    v32 = ["--model.name", "deepseek_v3", "--model.flavor", "v32_debugmodel", "--training.local_batch_size", "2",
           "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.last_save_model_only=false"]
    runs = [run_train([*v32, "--deepseek_v3.dense_warmup_steps", steps, "--checkpoint.enable", enable], 4)
            for steps, enable in (("2", "true"), ("0", "false"))]
    assert all(h["indexer_loss"] > 0 for h in runs[0]["history"]) and len(runs[0]["history"]) == 4
    assert runs[0]["losses"][1] != runs[1]["losses"][1]
    with caplog.at_level("WARNING", logger="tessera"):
        run = validate(parse_args(merge(BASE, [*v32, "--training.steps", "8", "--deepseek_v3.dense_warmup_steps", "3",
                                               "--deepseek_v3.indexer_loss_weight", "0.5"])), 1)
    assert run.cfg.deepseek_v3.indexer_loss_weight == 0.5
    at = f"in the checkpoint at {tmp_path}/checkpoint/step-4"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("deepseek_v3.")] == [
        f"deepseek_v3.indexer_loss_weight: 1.0 {at}, 0.5 from here on",
        f"deepseek_v3.dense_warmup_steps: 2 {at}, 3 from here on"]


def test_a_dense_warmup_as_long_as_the_run_is_said_in_one_line(caplog):
    """deepseek_v3.dense_warmup_steps >= training.steps: the run never attends sparsely (legitimate: the V3.2 report's
    first stage); one warning line says so. A shorter warm-up says nothing."""
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tests.dist_worker import BASE
    from tests.launch import merge

    label = "deepseek_v3 v32_debugmodel"
    cases = [("4", "4", "all", "every key attended"), ("4", "9", "indexer", "every key attended, the indexers alone "
                                                                            "trained"), ("4", "3", "all", None)]
    for steps, warmup, trains, what in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="tessera"):
            validate(parse_args(merge(BASE, ["--model.name", "deepseek_v3", "--model.flavor", "v32_debugmodel",
                                             "--training.steps", steps, "--deepseek_v3.dense_warmup_steps", warmup,
                                             "--deepseek_v3.dense_warmup_trains", trains])), 1)
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("deepseek_v3.dense_warmup")]
        assert said == ([f"deepseek_v3.dense_warmup_steps: {warmup}, and training.steps is {steps}: every step of "
                         f"this run is the dense warm-up ({what}), so {label} never trains sparse; set it below "
                         f"training.steps to train the sparse attention"] if what else [])


def test_an_indexer_only_warmup_trains_the_indexers_alone_then_everything(tmp_path):
    """deepseek_v3.dense_warmup_trains = "indexer": in the 2 warm-up steps only the indexers change (the others keep
    no gradient: no update, no weight decay, and the experts' selection bias stays); from step 3 all train. A flavor
    without an indexer refuses it in one line."""
    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import parse_args
    from tessera.train import train_step
    from tests.dist_worker import BASE, _trainer, expert_biases, full_params
    from tests.launch import merge

    warmup = ["--model.name", "deepseek_v3", "--deepseek_v3.dense_warmup_steps", "2",
              "--deepseek_v3.dense_warmup_trains", "indexer", "--moe.load_balance_rate", "1e-2"]
    tr = _trainer([*warmup, "--model.flavor", "v32_debugmodel"], 5, str(tmp_path))  # lr > 0 in step 3
    states = [(full_params(tr.step_parts.model), expert_biases(tr.step_parts.model))]
    for _ in range(3):
        train_step(tr)
        tr.progress.step += 1
        states.append((full_params(tr.step_parts.model), expert_biases(tr.step_parts.model)))
    tr.metrics.close()
    (start, biases), (warm, warm_biases), (third, third_biases) = states[0], states[2], states[3]
    changed = {name for name, value in warm.items() if not torch.equal(value, start[name])}
    indexers = {name for name in start if "indexer." in name}
    assert changed == indexers and indexers
    assert all(torch.equal(b, biases[n]) for n, b in warm_biases.items())
    assert {name for name, value in third.items() if not torch.equal(value, warm[name])} - indexers >= {
        "output.weight", "layers.1.attention.wkv_b.weight", "layers.2.feed_forward.experts.w1"}
    assert any(not torch.equal(b, biases[n]) for n, b in third_biases.items())
    with pytest.raises(ConfigError, match="^deepseek_v3.dense_warmup_trains: deepseek_v3 debugmodel has no indexer"):
        validate(parse_args(merge(BASE, [*warmup, "--model.flavor", "debugmodel"])), 1)


def test_fp8_release_style_weights_load_dequantized(tmp_path):
    """V3.2 released as V3 was: fp8 blocks with inverse scales (the indexer's projections among them); the logits
    equal transformers' on the same weights dequantized."""
    transformers = pytest.importorskip("transformers")
    from tests.test_deepseek_v3 import _quantize_fp8, dequantized_copy

    _theirs(tmp_path / "in", **V32["yarn_topk5"])
    _quantize_fp8(tmp_path / "in", 16)
    ours, _ = import_hf("deepseek_v3", tmp_path / "in")
    dequantized_copy(tmp_path / "in", tmp_path / "ref", 16)
    ref = transformers.DeepseekV32ForCausalLM.from_pretrained(tmp_path / "ref", attn_implementation="eager").eval()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_a_sequence_no_longer_than_the_top_k_runs_dense_with_a_warning(caplog):
    """A smoke run on short sequences is legitimate: it validates, and one line says the attention is dense."""
    import logging

    from tessera.preflight import validate
    from tessera.schema import parse_args

    with caplog.at_level(logging.WARNING, logger="tessera"):
        validate(parse_args(["--model.name", "deepseek_v3", "--model.flavor", "v32_debugmodel", "--training.seq_len",
                             "16"]), 1)
    said = [r.message for r in caplog.records if "index_topk" in r.message]
    assert said and said[0].startswith("training.seq_len: 16 tokens, and deepseek_v3 v32_debugmodel attends the top 16 "
                                       "keys (index_topk): every key, so its sparse attention computes as dense")


def test_compiled_sparse_blocks_compile_once_per_kind_not_per_block_or_step():
    """Each block compiled (dynamo with the eager backend: what recompiles is dynamo's, not inductor's): the step
    count the warm-up reads and a block's place in the model must not be compiled in, else a 61-block model would
    recompile per block and per step and fall back to eager past dynamo's limit. After the first step (one graph per
    kind of block: the dense first, the MoE ones), a second warm-up step recompiles nothing; the first sparse step
    recompiles once (the warm-up's end), the next nothing."""
    model = _model()
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    assert_steps_do_not_recompile(model, lambda m: m(tokens).float().logsumexp(-1).mean(), 4, {1, 3},
                                  lambda m, step: m.attend_every_key(step < 2))
