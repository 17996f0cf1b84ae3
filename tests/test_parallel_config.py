"""Bad parallel layouts are refused up front with one line naming the key and the reason."""

import re

import pytest

from tessera.config import ConfigError
from tessera.preflight import validate
from tessera.schema import parse_args
from tests.launch import merge

TINY = ["--model.flavor", "tiny", "--training.seq_len", "32"]
CASES = [  # (flags, world size, message fragment)
    (["--parallelism.tensor_parallel_degree", "4"], 4, "tensor_parallel_degree: 4 does not divide the KV heads (2)"),
    (["--parallelism.tensor_parallel_degree", "3"], 3, "does not divide the attention heads (4)"),
    (["--parallelism.tensor_parallel_degree", "2", "--model.flavor", "1B"], 2, "ties its embeddings"),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"], 2,
     "enable_async_tensor_parallel: needs CUDA and compile.enable"),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "3"], 4,
     "degrees multiply to 6"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Zigzag"], 2,
     "'Zigzag' is not one of GPipe, 1F1B, Interleaved1F1B"),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "1"], 2,
     "1 micro-batches (local_batch_size / pipeline_parallel_microbatch_size) for 2 stages; 1F1B needs at least"),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "6",
      "--parallelism.pipeline_parallel_microbatch_size", "4"], 2, "local_batch_size 6 is not divisible by"),
    (["--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 4,
     "2 layers cannot fill 8 stages"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_layers_per_stage", "1"], 2,
     "schedule 1F1B runs one stage per rank, but the layout gives 2"),
    (["--parallelism.pipeline_parallel_degree", "2", "--model.flavor", "3B"], 2, "ties its embeddings"),
    (["--parallelism.context_parallel_degree", "4", "--training.seq_len", "36"], 4,
     "seq_len 36 must be divisible by 2 x context_parallel_degree = 8"),
]


@pytest.mark.parametrize("flags,world,message", CASES)
def test_bad_layout_refused(flags, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(parse_args(merge(TINY, flags)), world)


def test_good_layouts_accepted():
    for flags, world in ((["--parallelism.tensor_parallel_degree", "2"], 8),
                         (["--parallelism.pipeline_parallel_degree", "2",
                           "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], 2),
                         (["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                           "--parallelism.pipeline_parallel_degree", "2"], 16)):
        dims = validate(parse_args([*TINY, *flags]), world).dims
        assert dims.dp_shard * dims.tp * dims.pp * dims.cp * dims.dp_replicate == world
