"""FSDP2 and HSDP equal a single-process run of the same global batch (fp32, same seed and data)."""

import pytest

from tests.launch import run_dist, run_local

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_local(tmp_path_factory.mktemp("ref"), "--training.local_batch_size", "8")


def _close(a, b, key, tol=TOL):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x[key] - y[key]) <= tol * max(1.0, abs(y[key])), (key, x["step"], x[key], y[key])


def test_fsdp2_matches_single_process(tmp_path, reference):
    got = run_dist(2, tmp_path, "--training.local_batch_size", "4")
    _close(got, reference, "loss")
    _close(got, reference, "grad_norm")


def test_hsdp_2x2_matches_single_process(tmp_path, reference):
    got = run_dist(4, tmp_path, "--training.local_batch_size", "2",
                   "--parallelism.data_parallel_replicate_degree", "2")
    _close(got, reference, "loss")
    _close(got, reference, "grad_norm")


def test_replicate_only_matches_single_process(tmp_path, reference):
    got = run_dist(2, tmp_path, "--training.local_batch_size", "4",
                   "--parallelism.data_parallel_replicate_degree", "2")
    _close(got, reference, "loss")


def test_grad_accumulation_equals_larger_batch(tmp_path, reference):
    got = run_local(tmp_path, "--training.local_batch_size", "4", "--training.global_batch_size", "8")
    _close(got, reference, "loss", tol=1e-6)
    _close(got, reference, "grad_norm", tol=1e-6)
