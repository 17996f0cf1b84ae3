"""Tensor parallel (+ sequence and loss parallel), alone and with FSDP / HSDP, equals one process."""

import pytest

from tests.dist_worker import run_grads
from tests.launch import assert_matches, run_cases

TOL = 1e-5
STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return run_grads(["--training.local_batch_size", "8"], STEPS)


def test_tp2_with_and_without_loss_parallel(tmp_path, reference):
    tp2 = ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]
    with_lp, without_lp = run_cases(2, tmp_path, [tp2, [*tp2, "--parallelism.disable_loss_parallel"]], STEPS)
    assert_matches(with_lp, reference, TOL)
    assert_matches(without_lp, reference, TOL)


def test_fsdp2_x_tp2(tmp_path, reference):
    (got,) = run_cases(4, tmp_path, [["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]],
                       STEPS)
    assert_matches(got, reference, TOL)


def test_hsdp_2x2_x_tp2(tmp_path, reference):
    (got,) = run_cases(8, tmp_path, [["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2",
                                      "--parallelism.data_parallel_replicate_degree", "2"]], STEPS)
    assert_matches(got, reference, TOL)
