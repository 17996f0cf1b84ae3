"""Qwen 3 MoE: counts against the published ones, logits, both HF directions and greedy generation against
transformers for a tiny random config, FSDP 2 equal to one process, and load balancing that balances."""

import dataclasses

import pytest
import torch

from tessera.checkpoint.hf import load_hf
from tessera.models import family, hf_args, num_params
from tessera.models.common.moe import MoE
from tests.dist_worker import run_train
from tests.hf_parity import assert_round_trip
from tests.launch import assert_matches, one_process, run_cases

MOE = family("qwen3_moe")


@pytest.mark.parametrize("flavor, total, active", [("30B-A3B", 30.5, 3.3), ("235B-A22B", 235, 22)])
def test_parameter_counts_match_the_published_ones(flavor, total, active):
    counts = MOE.counts(MOE.flavors[flavor], 4096)
    assert abs(counts.params / 1e9 - total) / total < 0.01 and abs(counts.active / 1e9 - active) / active < 0.03
    for debug in ("debugmodel_moe", "debugmodel_moe_dense_first"):
        with torch.device("meta"):
            model = MOE.spec().model(dataclasses.replace(MOE.flavors[debug], vocab_size=258))
        assert MOE.counts(model.args, 32).params == num_params(model)


_PATTERNS = {  # which blocks have experts, as transformers picks them: not only a dense prefix
    "every_block": {},
    "dense_between": dict(num_hidden_layers=4, mlp_only_layers=[1, 2]),  # experts in 0 and 3
    "every_other_but_one": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]),  # in 1 only
}


def _theirs(path, vocab_size: int = 97, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(**{
        "intermediate_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 6,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": vocab_size, "max_position_embeddings": 64,
        "bos_token_id": None, "eos_token_id": None, **overrides})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # HF starts the router at 0 and the q/k norms at 1: make both count
        for name, p in model.named_parameters():
            if "mlp.gate" in name or "experts" in name:
                p.normal_(0, 0.3)
            elif "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("pattern", sorted(_PATTERNS))
def test_logits_import_export_and_greedy_generation_equal_transformers(tmp_path, pattern):
    """Any pattern of dense and MoE blocks: ours has experts exactly where transformers' has them."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    theirs = _theirs(tmp_path / "in", **_PATTERNS[pattern])
    args = dataclasses.replace(hf_args("qwen3_moe", str(tmp_path / "in")), max_seq_len=32)
    with torch.device("meta"):
        ours = MOE.spec().model(args)
    sparse = [i for i, layer in enumerate(theirs.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
    assert list(args.moe.layers) == sparse
    assert [i for i, block in ours.layers.items() if isinstance(block.feed_forward, MoE)] == [str(i) for i in sparse]
    assert MOE.counts(args, 32).params == num_params(ours)
    ours.to_empty(device="cpu")
    ours.init_buffers(torch.device("cpu"))
    load_hf(ours.eval(), tmp_path / "in")
    assert_round_trip(theirs, ours, args, transformers.Qwen3MoeForCausalLM, tmp_path / "in", tmp_path)


@pytest.mark.ranks
def test_the_trainer_imports_and_exports_hf_with_experts_sharded(tmp_path):
    """Experts in blocks 0 and 3 of 4 (dense between). Under EP 2, EP 2 x FSDP 4 (experts sharded over both;
    and FSDP splitting every expert by rows), FSDP 2 and PP 2 x EP 2 (each stage a dense and a MoE block) each
    rank reads and writes only the experts it holds; lr 0 keeps the weights, so the export equals the HF model
    exactly (the trained expert bias is not part of HF's format)."""
    from transformers import Qwen3MoeForCausalLM

    from tests.launch import run_dist

    theirs = _theirs(tmp_path / "hf_in", vocab_size=300, **_PATTERNS["dense_between"])
    run = ["--model.name", "qwen3_moe", "--model.flavor=", "--training.steps", "1", "--optimizer.lr", "0",
           "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
           "--checkpoint.last_save_in_hf", "--checkpoint.initial_load_path", str(tmp_path / "hf_in"),
           "--training.local_batch_size", "2"]
    ep = ["--parallelism.expert_parallel_degree", "2"]
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
    rows = ["--parallelism.expert_fsdp_shard", "rows"]  # every expert split by rows over FSDP
    for name, ranks, layout in (("ep", 2, ep), ("ep_fsdp", 4, ep), ("fsdp", 2, []), ("pp_ep", 4, [*pp, *ep]),
                                ("ep_fsdp_rows", 4, [*ep, *rows])):
        run_dist(ranks, tmp_path / name, *run, *layout)
        exported = Qwen3MoeForCausalLM.from_pretrained(tmp_path / name / "checkpoint/exports/step-1")
        for key, value in theirs.state_dict().items():
            torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0, msg=f"{name} {key}")


@pytest.mark.ranks
def test_fsdp2_equals_one_process(tmp_path):
    """Experts sharded whole (4 a rank) and by rows (half of every expert's rows a rank)."""
    moe = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe"]
    reference = one_process([*moe, "--training.local_batch_size", "8"], 4)
    cases = [[*moe, "--training.local_batch_size", "4"],
             [*moe, "--training.local_batch_size", "4", "--parallelism.expert_fsdp_shard", "rows"]]
    for got in run_cases(2, cases, 4):
        assert_matches(got, reference, 1e-5, what=("grads", "params"))


def test_load_balancing_evens_the_expert_load():
    """100 steps of the debug model (8 x 128 tokens a step): the max / mean tokens per expert (mean over layers,
    last 10 steps) ends well below where it ends with neither the bias update nor the aux loss (README table)."""
    base = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--training.local_batch_size", "8",
            "--training.seq_len", "128", "--moe.load_balance_rate"]
    runs = {name: run_train([*base, *argv], 100)["history"]
            for name, argv in (("off", ["0"]), ("bias", ["1e-2"]), ("aux", ["0", "--moe.aux_loss_coef", "0.01"]))}
    end = {name: sum(h["moe_imbalance"] for h in history[-10:]) / 10 for name, history in runs.items()}
    assert end["bias"] < 0.8 * end["off"] and end["aux"] < 0.8 * end["off"], end
    assert "moe_aux_loss" in runs["aux"][-1] and "moe_aux_loss" not in runs["off"][-1]
    # Summed over the 2 layers, each near its floor (coef x 1 when perfectly even).
    assert runs["aux"][-1]["moe_aux_loss"] == pytest.approx(2 * 0.01, rel=0.2)


def test_validation_leaves_the_expert_load_counts_to_training(tmp_path):
    """The held-out batches' routing is no load the next bias update balances: after validation every MoE layer's
    counts (and balancing loss) are zero again, as after a step's update."""
    from tessera.train import train_step, validate_loss
    from tests.dist_worker import _trainer

    tr = _trainer(["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--validation.enable",
                   "--validation.steps", "1", "--moe.aux_loss_coef", "0.01"], 1, str(tmp_path))
    train_step(tr)
    validate_loss(tr)
    layers = tr.balancer.layers
    assert layers and all(m.tokens_per_expert.sum() == 0 and m.aux_loss_sum == 0 for m in layers)
