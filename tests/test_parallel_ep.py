"""Expert parallelism on the Qwen 3 MoE debug model (8 experts, top-2), composed with FSDP/HSDP, TP, PP, CP,
activation checkpointing and compile: every layout equals one process (fp32, same seed and data) in per-step losses and
grad norms, step-1 gradients and final parameters within 1e-5, with the aux-loss-free bias update on (so the
token counts summed over ranks are checked too, from step 2 on). Checkpoints reshard across EP degrees, and
layouts EP cannot take are refused in one line."""

import pytest
import torch

from tessera.config import ConfigError
from tessera.preflight import validate
from tessera.schema import parse_args
from tests.dist_worker import run_train
from tests.launch import assert_matches, one_process, resume_copy, run_cases

STEPS, TOL = 4, 1e-5
MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe"]
AUX = ["--moe.aux_loss_coef", "0.01"]


def ep(n: int, batch: int, *more: str) -> list[str]:
    return [*MOE, "--training.local_batch_size", str(batch), "--parallelism.expert_parallel_degree", str(n), *more]


PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2")
TP = ("--parallelism.tensor_parallel_degree", "2")
ROWS = "--parallelism.expert_fsdp_shard=rows"  # FSDP splits every expert along its rows


@pytest.fixture(scope="module")
def reference():
    return one_process([*MOE, "--training.local_batch_size", "8"], STEPS)


@pytest.mark.ranks
def test_ep2_ep2_x_cp2_and_ep2_compiled(tmp_path, reference):
    cases = [ep(2, 4), ep(2, 8, "--parallelism.context_parallel_degree", "2"), ep(2, 4, "--compile.enable")]
    for got in run_cases(2, cases, STEPS):
        assert_matches(got, reference, TOL, what=("grads", "params"))


@pytest.mark.ranks
def test_ep2_with_fsdp_hsdp_tp_pp_and_the_aux_loss_under_pp_and_accumulation(tmp_path, reference):
    """4 ranks: EP 2 x FSDP (dense sharded 4 ways, experts 2; and the experts split by rows), HSDP 2x2 x EP 2,
    EP 2 x TP 2, EP 2 x PP 2; then the sequence-wise aux loss (its gradient starts at each layer, on whichever
    stage) under PP 2 x EP 2 with 2 accumulation steps against one process adding it to the loss; PP 2 x EP 2 with
    a dense first block, so that the first stage holds no experts; and EP 2 x TP 2 with it (its SwiGLU split by
    TP, as a dense model's)."""
    dense_first = ["--model.flavor", "debugmodel_moe_dense_first"]
    cases = [ep(2, 2), ep(2, 2, ROWS), ep(2, 2, "--parallelism.data_parallel_replicate_degree", "2"), ep(2, 4, *TP),
             ep(2, 4, *PP),
             ep(2, 2, *PP[:2], "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.global_batch_size",
                "8", *AUX), ep(2, 4, *PP, *dense_first), ep(2, 4, *TP, *dense_first)]
    *layouts, aux, no_experts_stage, tp_dense_first = run_cases(4, cases, STEPS)
    for got in layouts:
        assert_matches(got, reference, TOL, what=("grads", "params"))
    dense_first_reference = one_process([*MOE, "--training.local_batch_size", "8", *dense_first], STEPS)
    for got, ref in ((aux, one_process([*MOE, "--training.local_batch_size", "8", *AUX], STEPS)),
                     (no_experts_stage, dense_first_reference), (tp_dense_first, dense_first_reference)):
        assert_matches(got, ref, TOL, what=("grads", "params"))


@pytest.mark.ranks
def test_8_ranks_ep_x_fsdp_x_tp_x_pp_with_full_activation_checkpointing(tmp_path, reference):
    """PP 2 x TP 2 x FSDP 2, EP 2 taking in the TP pairs; recomputation must not count tokens twice."""
    (got,) = run_cases(8, [ep(2, 4, *PP, *TP, "--activation_checkpoint.mode", "full")], STEPS)
    assert_matches(got, reference, TOL, what=("grads", "params"))


@pytest.mark.ranks
def test_checkpoints_reshard_across_ep_degrees(tmp_path):
    """Saved under EP 2 at step 4, resumed with one process, EP 4, and FSDP 2 without EP (splitting every expert
    by rows): each continues the uninterrupted run (losses 5-8, final parameters and expert biases)."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]
    src = tmp_path / "ep2"
    (full,) = run_cases(2, [["--job.dump_folder", str(src), *ep(2, 4), *ckpt]], 8, mode="train")
    one = run_train(["--job.dump_folder", str(resume_copy(src, tmp_path / "one", 4)), *ep(1, 8), *ckpt], 8)
    four, fsdp = run_cases(4, [
        ["--job.dump_folder", str(resume_copy(src, tmp_path / "ep4", 4)), *ep(4, 2), *ckpt],
        ["--job.dump_folder", str(resume_copy(src, tmp_path / "fsdp", 4)), *ep(1, 2, ROWS), *ckpt]], 8,
        mode="train")
    for resumed in (one, four, fsdp):
        assert resumed["start"] == 4
        for step in range(5, 9):
            assert abs(resumed["losses"][step] - full["losses"][step]) <= TOL
        for name, value in {**resumed["params"], **resumed["biases"]}.items():
            torch.testing.assert_close(value, {**full["params"], **full["biases"]}[name], rtol=TOL, atol=TOL)
    assert len(full["biases"]) == 2 and all(b.abs().max() > 0 for b in full["biases"].values())


@pytest.mark.parametrize(("argv", "world", "line"), [
    (ep(3, 1), 3, "parallelism.expert_parallel_degree: qwen3_moe debugmodel_moe has 8 experts per layer, which EP "
                  "must divide; set it to 1 or a divisor"),
    (ep(4, 1), 2, "parallelism.expert_parallel_degree: 4 must be a multiple of context_parallel x tensor_parallel "
                  "degrees (1 x 1) and divide data_parallel_shard x context x tensor degrees (2 x 1 x 1)"),
    (ep(2, 1, "--parallelism.tensor_parallel_degree", "4"), 4, "parallelism.expert_parallel_degree: 2 must be a "
                                                              "multiple of context_parallel x tensor_parallel"),
    ([*MOE, *TP, *AUX], 2, "moe.aux_loss_coef: the sequence-wise balancing loss needs each rank to hold whole "
                           "sequences, which TP and CP ranks do not"),
])
def test_layouts_ep_cannot_take_are_refused(argv, world, line):
    with pytest.raises(ConfigError, match="^" + line.replace("(", r"\(").replace(")", r"\)")):
        validate(parse_args(argv), world)
