"""Tensor parallel (+ sequence and loss parallel), alone and with FSDP / HSDP, equals one process."""

import pytest
import torch

from tests.launch import assert_matches, one_process, resume_copy, run_cases

pytestmark = pytest.mark.ranks  # every test here starts ranks

TOL = 1e-5
STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return one_process(["--training.local_batch_size", "8"], STEPS)


def test_tp2_with_and_without_loss_parallel(tmp_path, reference):
    """The loss chunked (the default, as the reference's), vocab-sharded or gathered; and unchunked."""
    tp2 = ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]
    with_lp, without_lp, whole_logits = run_cases(2, [tp2, [*tp2, "--parallelism.disable_loss_parallel"],
                                                                [*tp2, "--training.loss_chunks", "1"]], STEPS)
    assert_matches(with_lp, reference, TOL)
    assert_matches(without_lp, reference, TOL)
    assert_matches(whole_logits, reference, TOL)


def test_fsdp2_x_tp2(tmp_path, reference):
    (got,) = run_cases(4, [["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]],
                       STEPS)
    assert_matches(got, reference, TOL)


def test_hsdp_2x2_x_tp2(tmp_path, reference):
    (got,) = run_cases(8, [["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2",
                                      "--parallelism.data_parallel_replicate_degree", "2"]], STEPS)
    assert_matches(got, reference, TOL)


def test_tp_checkpoint_resumes_under_fsdp_and_the_reverse(tmp_path):
    tp = ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]
    fsdp = ["--training.local_batch_size", "4"]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]
    tp_run, fsdp_run = run_cases(2, [["--job.dump_folder", str(tmp_path / "tp"), *tp, *ckpt],
                                               ["--job.dump_folder", str(tmp_path / "fsdp"), *fsdp, *ckpt]],
                                 8, mode="train")
    to_fsdp, to_tp = run_cases(2, [
        ["--job.dump_folder", str(resume_copy(tmp_path / "tp", tmp_path / "tp_to_fsdp", 4)), *fsdp, *ckpt],
        ["--job.dump_folder", str(resume_copy(tmp_path / "fsdp", tmp_path / "fsdp_to_tp", 4)), *tp, *ckpt]],
        8, mode="train")
    for resumed, original in ((to_fsdp, tp_run), (to_tp, fsdp_run)):
        assert resumed["start"] == 4
        for step in range(5, 9):
            assert abs(resumed["losses"][step] - original["losses"][step]) <= TOL
        for name, value in resumed["params"].items():
            torch.testing.assert_close(value, original["params"][name], rtol=TOL, atol=TOL)


def test_block_causal_under_tp2_and_fsdp2_equals_one_process(tmp_path):
    """Short documents packed several to a window: block-causal attention (each document attends only itself)
    changes the losses, and TP 2 and FSDP 2 compute it as one process does."""
    import json

    docs = tmp_path / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {k}: " + "ab cd " * (k % 5)}) + "\n" for k in range(400)))
    data = ["--training.dataset", "files", "--training.dataset_path", str(docs), "--model.attn_mask_type",
            "block_causal"]
    reference = one_process([*data, "--training.local_batch_size", "8"], 4)
    causal = one_process([*data[:-1], "causal", "--training.local_batch_size", "8"], 4)
    grads = reference["grads"]["layers.0.attention.wq.weight"], causal["grads"]["layers.0.attention.wq.weight"]
    assert (grads[0] - grads[1]).abs().max() > 0.1 * grads[1].abs().max()  # the mask matters
    cases = [[*data, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
             [*data, "--training.local_batch_size", "4"]]
    for name, got in zip(["tp2", "fsdp2"], run_cases(2, cases, 4), strict=True):
        try:
            assert_matches(got, reference, TOL, what=("grads", "params"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
