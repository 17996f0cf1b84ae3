"""DeepSeek V3's multi-token prediction under pipeline parallelism: the depths on the last stage, the embeddings
of the whole sequence carried to them beside the hidden states (DeepSeekV3.carries_embeddings)."""

import pytest

pytestmark = pytest.mark.ranks  # every test here starts ranks


def test_mtp_under_pp_equals_one_process(tmp_path):
    """2 MTP depths on 4 ranks, each layout equal to one process within 1e-5 (per-step losses, grad norms and
    mtp_loss metrics; step-1 gradients of every parameter, the embedding's included; final parameters): PP 2 x
    FSDP 2 under 1F1B (2 micro-batches per step) and under Interleaved1F1B (4 stages: the first holds only the
    embedding, the last only the final norm, the head and the depths), whose validation loss (the stream carried
    in eval too) is one process's too. And PP 2 x FSDP 2 in bf16, within 2%."""
    from tests.launch import assert_matches, one_process, run_cases

    mtp = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_mtp", "--moe.load_balance_rate", "1e-2"]
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
    validation = ["--validation.enable", "--validation.steps", "1"]
    reference = one_process([*mtp, "--training.local_batch_size", "8", *validation], 3)
    assert reference["grads"]["mtp.1.eh_proj.weight"].abs().sum() > 0 and all(reference["side_losses"])
    one_f_one_b = [*mtp, *pp, "--parallelism.pipeline_parallel_microbatch_size", "2"]
    cases = [one_f_one_b, [*mtp, *pp, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", *validation],
             [*one_f_one_b, "--training.mixed_precision_param", "bfloat16"]]
    one, interleaved, bf16 = run_cases(4, cases, 3)
    assert abs(interleaved["validation"] - reference["validation"]) < 1e-5
    for got in (one, interleaved):
        assert_matches(got, reference, 1e-5, what=("grads", "params"))
        for mine, theirs in zip(got["side_losses"], reference["side_losses"], strict=True):
            assert mine.keys() == {"mtp_loss"} and abs(mine["mtp_loss"] - theirs["mtp_loss"]) < 1e-5
    assert_matches(bf16, reference, 2e-2, what=())
    for mine, theirs in zip(bf16["side_losses"], reference["side_losses"], strict=True):
        assert abs(mine["mtp_loss"] - theirs["mtp_loss"]) < 2e-2 * theirs["mtp_loss"]
