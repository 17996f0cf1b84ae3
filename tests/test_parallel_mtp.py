"""DeepSeek V3's multi-token prediction under TP (with and without loss parallel) and CP (all-gather and
Ulysses, with documents packed into each window and their first labels masked): each layout's losses, grad
norms, step-1 gradients (the depths' included) and final parameters equal one fp32 process."""

import json

import pytest

from tests.launch import assert_matches, one_process, run_cases

pytestmark = pytest.mark.ranks  # every test here starts ranks

MODEL = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_mtp", "--moe.load_balance_rate", "1e-2",
         "--deepseek_v3.mtp_loss_weight", "0.3"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
BATCH = "--training.local_batch_size"
UNTRAINED = ["--deepseek_v3.mtp_loss_weight", "0"]
STEPS = 3


def test_mtp_layouts_equal_one_process(tmp_path):
    """One 4-rank launch: TP 2 x FSDP 2 (loss parallel); TP 2 x FSDP 2 without loss parallel; CP 2 x FSDP 2
    (all-gather); CP 2 x TP 2 (Ulysses: 4 heads over 4 ranks); CP 2 x FSDP 2 with documents packed into each window
    (block-causal, each document's first label masked: each depth's shifted tokens, documents, positions and
    targets cross the chunks, and its trained targets, unequal over the ranks, are counted over DP and CP); and TP 2
    x FSDP 2 at weight 0 (the depths split, kept, untrained)."""
    docs = tmp_path / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {k}: " + "ab cd " * (k % 5)}) + "\n" for k in range(400)))
    packed = ["--training.dataset", "files", "--training.dataset_path", str(docs), "--model.attn_mask_type",
              "block_causal"]
    cases = {"TP 2 x FSDP 2": [BATCH, "4", *TP2],
             "TP 2 x FSDP 2, no loss parallel": [BATCH, "4", *TP2, "--parallelism.disable_loss_parallel"],
             "CP 2 x FSDP 2": [BATCH, "4", *CP2],
             "CP 2 (Ulysses) x TP 2": [BATCH, "8", *CP2, *TP2, "--parallelism.context_parallel_method", "ulysses"],
             "documents, CP 2 x FSDP 2": [*packed, BATCH, "4", *CP2],
             "untrained, TP 2 x FSDP 2": [BATCH, "4", *TP2, *UNTRAINED]}
    results = run_cases(4, [[*MODEL, *case] for case in cases.values()], STEPS)
    reference = one_process([*MODEL, BATCH, "8"], STEPS)
    assert reference["grads"]["mtp.1.eh_proj.weight"].abs().sum() > 0  # the depths train
    others = {"documents": one_process([*MODEL, *packed, BATCH, "8"], STEPS),
              "untrained": one_process([*MODEL, *UNTRAINED, BATCH, "8"], STEPS)}
    for name, got in zip(cases, results, strict=True):
        try:
            assert_matches(got, others.get(name.split(",")[0], reference), 1e-5, what=("grads", "params"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
