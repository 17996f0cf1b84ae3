"""Context parallel (head-tail load balanced, all-gather attention on plain collectives) and full 4D,
each equal to a single-process run (fp32, same seed and data)."""

import pytest
import torch

from tessera.parallel.cp import shard_sequence
from tests.launch import assert_matches, one_process, run_cases

TOL = 1e-5
STEPS = 5


@pytest.fixture(scope="module")
def reference():
    return one_process(["--training.local_batch_size", "8"], STEPS)


def test_head_tail_sharding():
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(x, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard_sequence(torch.arange(16), 1, 4, dim=0).tolist() == [2, 3, 12, 13]


@pytest.mark.ranks
def test_cp2_and_cp2_with_tp2_and_fsdp2(tmp_path, reference):
    cp2 = ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"]
    (got,) = run_cases(2, [cp2], STEPS)
    assert_matches(got, reference, TOL, what=("grads", "params"))
    with_tp, with_fsdp = run_cases(4, [[*cp2, "--parallelism.tensor_parallel_degree", "2"],
                                                 ["--parallelism.context_parallel_degree", "2",
                                                  "--training.local_batch_size", "4"]], STEPS)
    assert_matches(with_tp, reference, TOL, what=("grads", "params"))
    assert_matches(with_fsdp, reference, TOL, what=("grads", "params"))


@pytest.mark.ranks
def test_cp4(tmp_path, reference):
    cp4 = ["--parallelism.context_parallel_degree", "4", "--training.local_batch_size", "8"]
    (got,) = run_cases(4, [cp4], STEPS)
    assert_matches(got, reference, TOL, what=("grads", "params"))


@pytest.mark.ranks
def test_4d_fsdp2_tp2_pp2_cp2(tmp_path, reference):
    (got,) = run_cases(16, [["--parallelism.context_parallel_degree", "2",
                                       "--parallelism.tensor_parallel_degree", "2",
                                       "--parallelism.pipeline_parallel_degree", "2",
                                       "--training.local_batch_size", "4"]], STEPS, timeout=900)
    assert_matches(got, reference, TOL, what=("grads", "params"))
