"""Options that trade a little compute for memory (#29): each equals the default path, and the live-memory count
(metrics.live_memory) shows the bytes it saves."""

import pytest

from tests.dist_worker import run_grads
from tests.launch import assert_matches, run_local
from tests.test_prepared import word_tokenizer

STEPS = 3


# ---------------------------------------------------------------- chunked output head and loss

@pytest.fixture(scope="module")
def whole_logits():
    return run_grads(["--training.local_batch_size", "4", "--training.loss_chunks", "1"], STEPS)


@pytest.mark.parametrize("chunks", ["8", "3"])  # 3: slices of 11, 11 and 10 tokens
def test_chunked_loss_equals_the_whole_logits(chunks, whole_logits):
    chunked = run_grads(["--training.local_batch_size", "4", "--training.loss_chunks", chunks], STEPS)
    assert_matches(chunked, whole_logits, 1e-6)


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
