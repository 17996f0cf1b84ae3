"""Options that trade a little compute for memory (#29): each equals the default path, and the live-memory count
(metrics.live_memory) shows the bytes it saves."""

import pytest
import torch

from tests.launch import assert_matches, one_process, run_dist, run_local
from tests.test_prepared import word_tokenizer

STEPS = 3


# ---------------------------------------------------------------- chunked output head and loss

MTP = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_mtp"]  # its depths' losses are chunked too


@pytest.mark.parametrize(("model", "chunks"), [([], "8"), ([], "3"), (MTP, "8")])  # 3: slices of 11, 11, 10 tokens
def test_chunked_loss_equals_the_whole_logits(model, chunks):
    whole = one_process([*model, "--training.local_batch_size", "4", "--training.loss_chunks", "1"], STEPS)
    chunked = one_process([*model, "--training.local_batch_size", "4", "--training.loss_chunks", chunks], STEPS)
    assert_matches(chunked, whole, 1e-6)


def test_chunked_loss_cuts_the_logits_term_of_the_peak(tmp_path):
    """A tiny model with a 32k vocabulary, 1024 tokens a step: unchunked, the loss holds three [tokens, vocab] fp32
    tensors at once (logits, their log-softmax kept for backward, its gradient); in 8 chunks each is an eighth."""
    tok = word_tokenizer(tmp_path / "tok", 32_000)
    peak = {}
    for chunks in ("1", "8"):
        metrics = run_local(tmp_path / chunks, "--model.hf_assets_path", str(tok), "--training.seq_len", "256",
                            "--training.local_batch_size", "4", "--training.steps", "1", "--metrics.live_memory",
                            "--training.loss_chunks", chunks)
        peak[chunks] = metrics[-1]["live_peak_gib"] * 2**30
    logits = 3 * 1024 * 32_010 * 4
    # Measured: 402.5 MiB whole, 82.3 MiB in 8 chunks (the logits term 375 MiB -> 47 MiB).
    assert abs((peak["1"] - peak["8"]) - logits * (1 - 1 / 8)) < 0.05 * logits, peak


# ---------------------------------------------------------------- PP + FSDP: gradients reduced per micro-batch

PP_FSDP = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "4",
           "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]


@pytest.mark.ranks
def test_reducing_each_microbatch_holds_only_sharded_gradients(tmp_path):
    """PP 2 x FSDP 2, 4 micro-batches. Estimated: torch's way holds each stage's whole gradients and gathered
    parameters to the step's end (grads about 4 x the stage's parameter shards); reduced per micro-batch, about
    the shards' size. Counted live (metrics.live_memory): the peak falls too (measured 41.2 -> 37.1 MiB)."""
    from tessera.config import parse_args
    from tessera.estimate.core import estimate

    kinds, peak = {}, {}
    for mode in ("step", "microbatch"):
        flags = [*PP_FSDP, "--parallelism.pipeline_parallel_grad_reduce", mode]
        kinds[mode] = estimate(parse_args(flags), 4, "cpu").kinds
        metrics = run_dist(4, tmp_path / mode, *flags, "--training.steps", "2", "--metrics.live_memory")
        peak[mode] = metrics[-1]["live_peak_gib"] * 2**30
    for step, each in zip(kinds["step"], kinds["microbatch"], strict=True):
        assert step.grads > 3.5 * step.params and each.grads < each.params, (step, each)
    assert peak["microbatch"] < peak["step"] - 3 * 2**20, peak


# ---------------------------------------------------------------- bf16 Adam moments

def test_bf16_moments_halve_the_state_and_stay_near_fp32_states(tmp_path):
    """optimizer.state_dtype = bfloat16: both moments are bf16 (the parameters fp32), half the bytes; over 20 steps
    the loss stays within 1e-3 of fp32 states (measured: at most 9.1e-5) and is not the same run."""
    from tests.dist_worker import _trainer, step_and_record

    runs, state_bytes = {}, {}
    for dtype in ("float32", "bfloat16"):
        tr = _trainer(["--training.local_batch_size", "4", "--optimizer.state_dtype", dtype], 20, str(tmp_path / dtype))
        runs[dtype] = step_and_record(tr, 20)
        moments = [v for s in tr.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")]
        assert {m.dtype for m in moments} == {getattr(torch, dtype)}
        assert {p.dtype for p in tr.step_parts.model.parameters()} == {torch.float32}
        state_bytes[dtype] = sum(m.nbytes for m in moments)
    assert state_bytes["bfloat16"] * 2 == state_bytes["float32"]
    gaps = [abs(a - b) for a, b in zip(runs["bfloat16"]["losses"], runs["float32"]["losses"], strict=True)]
    assert 0 < max(gaps) < 1e-3, gaps


# ---------------------------------------------------------------- experts split by rows instead of padded

def test_experts_a_rank_cannot_hold_whole_are_split_by_rows_without_padding():
    """Qwen 3 MoE debug (8 experts [8, 32, 64] x 3 per layer, 2 layers) on 16 ranks, EP 8: one expert per EP rank,
    split over an FSDP group of 2. Whole experts pad it to two (one rank holds an empty one); auto splits each
    expert's rows, half a rank, no padding: the live bytes of parameters (counted as metrics.live_memory counts
    them, on the estimate's fake ranks) fall by exactly that half expert per layer, and gradients and Adam's
    state with them."""
    from tessera.config import parse_args
    from tessera.estimate.core import estimate

    kinds = {}
    for mode in ("experts", "auto"):
        cfg = parse_args(["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--training.seq_len", "32",
                          "--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "8",
                          "--parallelism.expert_fsdp_shard", mode])
        (kinds[mode],) = estimate(cfg, 16, "cpu").kinds
    padding = 2 * 3 * 32 * 64 * 4 // 2  # layers x (w1, w2, w3) x half an expert's fp32 bytes
    assert kinds["experts"].params - kinds["auto"].params == padding, kinds
    assert kinds["experts"].optimizer - kinds["auto"].optimizer == 2 * padding, kinds
