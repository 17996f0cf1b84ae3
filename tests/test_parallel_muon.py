"""Muon under every layout equals one process (fp32 Newton-Schulz, same seed and data): per-step losses and grad
norms, and final parameters within 1e-5, on the Qwen 3 MoE debug model (dense matrices and experts' stacks), with
parameter groups on. A one-process Muon checkpoint resumes resharded (momentum buffers and Adam moments both)."""

import pytest
import torch

from tests.dist_worker import run_train
from tests.launch import resume_copy, run_cases
from tests.test_checkpoint import CKPT
from tests.test_speed_features import F8, LOW_PRECISION_TOL

pytestmark = pytest.mark.ranks  # every test here starts ranks

STEPS, TOL = 4, 1e-5
MUON = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--optimizer.name", "Muon",
        "--optimizer.muon_ns_dtype", "float32", "--optimizer.weight_decay_exclude",
        "--optimizer.output_lr_multiplier", "0.5", *CKPT, "--checkpoint.interval", "2"]
# MuonClip: DeepSeek's MLA with QK-clip low enough to clip heads at each step (lr high, no warmup)
QK_CLIP = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--optimizer.name", "Muon",
           "--optimizer.muon_ns_dtype", "float32", "--optimizer.qk_clip_threshold", "0.05", "--optimizer.lr", "0.02",
           "--lr_scheduler.warmup_steps", "1"]
TP = ("--parallelism.tensor_parallel_degree", "2")
PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2")
EP = ("--parallelism.expert_parallel_degree", "2")


def case(dump, batch: int, *more: str) -> list[str]:
    return [*MUON, "--job.dump_folder", str(dump), "--training.local_batch_size", str(batch), *more]


def assert_same_run(got: dict, ref: dict, steps) -> None:
    for step in steps:
        mine, theirs = got["history"][step - 1 - got["start"]], ref["history"][step - 1]
        for key in ("loss", "grad_norm"):
            assert abs(mine[key] - theirs[key]) <= TOL * max(1.0, abs(theirs[key])), \
                f"step {step}: {key} {mine[key]} vs one process {theirs[key]}"
    assert got["params"].keys() == ref["params"].keys()
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref["params"][name], rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_muon_fsdp_tp_hsdp_ep_pp_and_resharded_resume_equal_one_process(tmp_path):
    """4 ranks: FSDP 2 x TP 2, HSDP 2 x FSDP 2, EP 2 x FSDP 2 (dense sharded 4 ways), PP 2 x FSDP 2 x EP 2; then the
    one-process run's step-2 checkpoint resumed under EP 2 x TP 2; then float8 (emulated) with FSDP float8
    all-gathers, whose weights are torchao wrapper tensors Muon steps through, against one process in high
    precision (within float8's rounding, as tests/test_speed_features.py); then MuonClip (QK-clip on DeepSeek's
    MLA) under FSDP 2 x TP 2: the largest logits over the data-parallel ranks, each TP rank's heads, the scales
    on strided FSDP x TP shards, and the metrics, as one process's."""
    one = run_train(case(tmp_path / "one", 8), STEPS)
    dense = ["--optimizer.name", "Muon", "--training.local_batch_size", "2"]
    dense_one = run_train([*dense[:2], "--training.local_batch_size", "8"], STEPS)
    cases = [case(tmp_path / "tp", 4, *TP), case(tmp_path / "hsdp", 2, "--parallelism.data_parallel_replicate_degree",
                                                 "2"),
             case(tmp_path / "ep", 2, *EP), case(tmp_path / "pp", 4, *PP, *EP),
             case(resume_copy(tmp_path / "one", tmp_path / "resumed", 2), 4, *EP, *TP),
             [*dense, *F8, "--quantize.linear.float8.enable_fsdp_float8_all_gather"]]
    clip = [*QK_CLIP, "--training.local_batch_size", "8"]
    clip_one = run_train(clip, STEPS)
    cases.append([*QK_CLIP, "--training.local_batch_size", "4", *TP])
    *layouts, resumed, float8, clipped = run_cases(4, cases, STEPS, mode="train")
    for got in layouts:
        assert_same_run(got, one, range(1, STEPS + 1))
    assert_same_run(clipped, clip_one, range(1, STEPS + 1))
    assert all(h["qk_clipped_heads"] > 0 for h in clip_one["history"])  # clipping at every step, as one process's
    for mine, theirs in zip(clipped["history"], clip_one["history"], strict=True):
        assert (mine["qk_clipped_heads"], mine["qk_max_logit"]) == pytest.approx(
            (theirs["qk_clipped_heads"], theirs["qk_max_logit"]), rel=TOL)
    assert resumed["start"] == 2
    assert_same_run(resumed, one, range(3, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(float8["losses"][step] - dense_one["losses"][step]) < LOW_PRECISION_TOL


def test_muon_8_ranks_pp_x_tp_x_fsdp_x_ep(tmp_path):
    """PP 2 x TP 2 x FSDP 2 with EP 2: matrices split over two mesh axes (FSDP and TP) gathered whole."""
    one = run_train(case(tmp_path / "one", 8), STEPS)
    (got,) = run_cases(8, [case(tmp_path / "eight", 4, *PP, *TP, *EP)], STEPS, mode="train")
    assert_same_run(got, one, range(1, STEPS + 1))
