"""Ulysses context parallel (parallelism.context_parallel_method = ulysses: all-to-alls turn the sequence split
into a head split around attention), each layout and family equal to a single-process fp32 run."""

import json
import re

import pytest

from tessera.config import ConfigError
from tessera.preflight import validate
from tessera.schema import parse_args
from tests.launch import assert_matches, one_process, run_cases

U = ["--parallelism.context_parallel_method", "ulysses"]
CP2, CP4 = (["--parallelism.context_parallel_degree", n, *U] for n in ("2", "4"))
TP2, EP2 = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
BATCH = "--training.local_batch_size"
STEPS = 4


@pytest.mark.fast
def test_heads_that_do_not_divide_by_tp_x_cp_are_refused_at_launch():
    tiny = ["--model.flavor", "tiny", "--training.seq_len", "32", *U]
    message = ("parallelism.context_parallel_method: ulysses splits llama3's 4 attention heads over TP 2 x CP 4 = 8 "
               "ranks, which do not divide them; use a CP degree dividing the 2 heads per TP rank, or "
               "context_parallel_method = allgather")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        validate(parse_args([*tiny, "--parallelism.context_parallel_degree", "4", *TP2]), 8)
    assert validate(parse_args([*tiny, "--parallelism.context_parallel_degree", "4"]), 4).dims.cp == 4  # 1 head each


@pytest.mark.ranks
def test_llama3_layouts_equal_one_process(tmp_path):
    """4 ranks, tiny Llama 3 (4 query heads, 2 KV heads): CP 2 x FSDP 2; CP 2 x TP 2 (one query and one KV head
    per TP rank: the KV head is repeated for the two CP ranks); CP 4 (likewise); PP 2 x CP 2; and documents packed
    into each window (block-causal) under CP 2 x FSDP 2, eager and with blocks compiled whole-graph and full AC
    (the whole sequence's document numbers gathered inside the compiled graph)."""
    docs = tmp_path / "short.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {k}: " + "ab cd " * (k % 5)}) + "\n" for k in range(400)))
    packed = ["--training.dataset", "files", "--training.dataset_path", str(docs), "--model.attn_mask_type",
              "block_causal"]
    reference = one_process([BATCH, "8"], STEPS)
    cases = [[BATCH, "4", *CP2], [BATCH, "8", *CP2, *TP2], [BATCH, "8", *CP4], [BATCH, "8", *CP2, *PP2],
             [*packed, BATCH, "4", *CP2],
             [*packed, BATCH, "4", *CP2, "--compile.enable", "--activation_checkpoint.mode", "full"]]
    names = ["CP 2 x FSDP 2", "CP 2 x TP 2", "CP 4", "PP 2 x CP 2", "documents", "documents, compiled, full AC"]
    masked = one_process([*packed, BATCH, "8"], STEPS)
    for name, got, ref in zip(names, run_cases(4, cases, STEPS), [reference] * 4 + [masked] * 2,
                              strict=True):
        try:
            assert_matches(got, ref, 1e-5, what=("grads", "params"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


FAMILIES = {  # name: (model flags, this layout's flags and batch); 4 ranks
    "Qwen 3 (q/k norms), CP 2 x FSDP 2": (["--model.name", "qwen3", "--model.flavor", "tiny"], ["4", *CP2]),
    "Qwen 3 MoE, CP 2 x EP 2": (["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe"], ["4", *CP2, *EP2]),
    "DeepSeek V3 (MLA), CP 2 x EP 2": (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
                                       ["4", *CP2, *EP2]),
    "GPT-OSS (sinks, sliding windows), CP 2 x TP 2": (["--model.name", "gpt_oss", "--model.flavor", "debugmodel"],
                                                      ["8", *CP2, *TP2]),
    "Llama 4 (chunks, NoPE), CP 2 x FSDP 2": (["--model.name", "llama4", "--model.flavor", "debugmodel"],
                                             ["4", *CP2]),
    "Flux (joint attention), CP 2 x FSDP 2": (["--model.name", "flux", "--model.flavor", "flux-debug",
                                              "--training.seq_len", "112", "--training.dataset", "shapes"],
                                             ["4", *CP2]),
}


@pytest.mark.ranks
def test_each_family_equals_one_process(tmp_path):
    """One 4-rank launch, a layout per family with attention: losses, grad norms, step-1 gradients and final
    parameters within 1e-5 of one process over the same global batch."""
    moe = ["--moe.load_balance_rate", "1e-2"]
    cases = [[*model, *moe, BATCH, *layout] for model, layout in FAMILIES.values()]
    for name, got, (model, _) in zip(FAMILIES, run_cases(4, cases, STEPS), FAMILIES.values(), strict=True):
        try:
            assert_matches(got, one_process([*model, *moe, BATCH, "8"], STEPS), 1e-5, what=("grads", "params"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
