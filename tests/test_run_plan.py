"""validate returns one immutable record of what it resolved (tessera.run_plan.ResolvedRun), and the batch
arithmetic and the family look-up are written once, where every consumer reads them."""

import dataclasses
import pathlib
import re

import pytest

from tessera import models
from tessera.data.tokenizer import ByteTokenizer
from tessera.ft.check import place_group
from tessera.models.llama3 import FAMILY as LLAMA3
from tessera.parallel.dims import ParallelDims
from tessera.preflight import validate
from tessera.run_plan import Batch, DataPlan
from tessera.schema import parse_args
from tests.launch import merge

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4"]


def test_fsdp_with_accumulation(tmp_path):
    cfg = parse_args(merge(TINY, ["--job.dump_folder", str(tmp_path), "--training.global_batch_size", "24"]))
    run = validate(cfg, 2)
    # The config as it runs: model.attn_mask_type = auto resolved (causal for text); the one given left as it was.
    assert run.cfg == dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_mask_type="causal"))
    assert cfg.model.attn_mask_type == "auto" and run.family is models.family("llama3") is LLAMA3
    # Final: the tiny flavor takes its tokenizer's vocabulary, the built-in byte tokenizer's here (what ranks build).
    assert run.args == dataclasses.replace(LLAMA3.flavors["tiny"], max_seq_len=32, vocab_size=ByteTokenizer.vocab_size)
    assert run.dims == ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    assert run.batch == Batch(local=4, data_parallel=2, accumulation=3, micro_batches=3, global_sequences=24,
                              global_tokens=24 * 32)
    assert run.resume is None
    assert run.data == DataPlan(own=False, prepared=False, resumes_position=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch.accumulation = 1


def test_pipeline_and_replica_groups(tmp_path, monkeypatch):
    """PP cuts each local batch into micro-batches; fault tolerance deals the global batch to replica groups too,
    and places this group in its own folder in the record's config, not in the one given."""
    monkeypatch.setenv("LOCAL_RANK", "0")  # a running group's rank: the lighthouse is not asked
    cfg = parse_args(merge(TINY, ["--job.dump_folder", str(tmp_path), "--parallelism.pipeline_parallel_degree", "2",
                                  "--parallelism.pipeline_parallel_microbatch_size", "2",
                                  "--training.global_batch_size", "16", "--fault_tolerance.enable",
                                  "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1",
                                  "--fault_tolerance.lighthouse", "http://127.0.0.1:1"]))
    run = validate(cfg, 2)
    assert (run.dims.pp, run.dims.dp) == (2, 1)
    assert run.batch == Batch(local=4, data_parallel=2, accumulation=2, micro_batches=4, global_sequences=16,
                              global_tokens=16 * 32)
    assert cfg.job.dump_folder == str(tmp_path) and cfg.checkpoint.folder == "checkpoint"
    assert run.cfg.job.dump_folder == str(tmp_path / "replica_1")
    assert run.cfg.checkpoint.folder == str(tmp_path / "checkpoint")
    assert validate(cfg, 2) == run  # the same config resolves to the same record
    diloco = parse_args(merge(TINY, ["--job.dump_folder", str(tmp_path), "--fault_tolerance.enable",
                                     "--fault_tolerance.replica_id", "1", "--fault_tolerance.group_size", "2",
                                     "--fault_tolerance.semi_sync_method", "diloco"]))
    assert place_group(diloco).checkpoint.folder == str(tmp_path / "checkpoint" / "replica_1")  # each its own
    assert diloco.checkpoint.folder == "checkpoint"


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "tessera").rglob("*.py")}


def test_accumulation_formula_in_one_place():
    found = [path for path, text in _sources().items() if re.search(r"global_batch\w*\s*//", text)]
    assert found == ["tessera/run_plan.py"]


def test_consumers_read_the_family_from_the_record():
    consumers = ("tessera/trainer.py", "tessera/train.py", "tessera/estimate/", "tessera/data/", "tessera/ft/")
    found = [path for path, text in _sources().items()
             if path.startswith(consumers) and re.search(r"\bfamily\(", text)]
    assert not found
