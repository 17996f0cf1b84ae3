"""FSDP2, HSDP, replication and gradient accumulation equal a single-process run of the same global batch
(fp32, same seed and data): per-step losses and grad norms, step-1 gradients and final parameters."""

import pytest

from tests.launch import assert_matches, one_process, run_cases

TOL = 1e-5
STEPS = 5
WHAT = ("grads", "params")


@pytest.fixture(scope="module")
def reference():
    return one_process(["--training.local_batch_size", "8"], STEPS)


@pytest.mark.ranks
def test_fsdp2_and_replicate_only_match_single_process(tmp_path, reference):
    """And FSDP 2 with bf16 Adam moments (optimizer.state_dtype) equals one process with them: losses and
    gradients within TOL; parameters within lr x 2^-8 a step (a gradient summed in another order may round a
    moment to its bf16 neighbour)."""
    bf16_states = ["--optimizer.state_dtype", "bfloat16"]
    cases = [["--training.local_batch_size", "4"],
             ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2"],
             ["--training.local_batch_size", "4", *bf16_states]]
    references = [reference, reference, one_process(["--training.local_batch_size", "8", *bf16_states], STEPS)]
    for name, got, ref in zip(["fsdp2", "replicate2", "fsdp2, bf16 moments"], run_cases(2, cases, STEPS),
                              references, strict=True):
        try:
            if ref is not reference:
                assert_matches(got, ref, TOL, what=("grads",))
                assert_matches(got, ref, STEPS * 3e-3 * 2**-8, what=("params",))
                continue
            assert_matches(got, ref, TOL, what=WHAT)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.ranks
def test_hsdp_2x2_matches_single_process(tmp_path, reference):
    (got,) = run_cases(4, [["--training.local_batch_size", "2",
                                      "--parallelism.data_parallel_replicate_degree", "2"]], STEPS)
    assert_matches(got, reference, TOL, what=WHAT)


def test_grad_accumulation_equals_larger_batch(reference):
    got = one_process(["--training.local_batch_size", "4", "--training.global_batch_size", "8"], STEPS)
    assert_matches(got, reference, 1e-6, what=WHAT)
