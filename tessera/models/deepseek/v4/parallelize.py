"""DeepSeek V4's parallelism plan: the shared decoder's, its blocks' TP plan below.

TP splits the query heads: wq_b column-wise, the sinks and the grouped output projection's groups by head (each
rank's heads make whole groups), wo_b row-wise back to sequence shards. The query bottleneck and its norm, the one
key/value head, the compressors and the indexer stay whole on every rank and run on the gathered sequence; every
rank's heads read the key/value head and the compressed entries, so their gradients are summed over TP where they
leave their modules; the indexer's target, the heads' attention over the entries, is summed over them. The
hyper-connections' weights, computed per token, run on each rank's sequence slice with replicated parameters
(sequence parallel); so does the final collapse of the streams. A MoE block runs on the
rank's own tokens, and a hash-routed one takes their token ids, cut the same way. CP is refused (check_layout).

The MTP depths (the last stage's) are FSDP units of their own, each on the whole sequence: its block takes the
blocks' plan; its norms, projections and collapse of the streams run on each rank's sequence slice with
replicated weights (sequence parallel), the projections handing the block a plain slice as the embedding hands
the first block. Under PP they sit on the last stage, fed the first stage's embeddings through the stages
(tessera/models/deepseek/mtp.py). Under DP a depth's trained targets are counted over the data ranks."""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from tessera.models.common.plan import NORMS, parallelize_decoder
from tessera.models.deepseek.plan import split_lookahead
from tessera.models.deepseek.v4 import FAMILY
from tessera.parallel.tp import Replicated, ShardedByHead, SummedOverRanks


def block_tp_plan(head_dim: int):
    plan = {**{n: SequenceParallel() for n in NORMS},
            **{n: SequenceParallel(use_local_output=True) for n in ("attention_hc", "ffn_hc")},
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                            use_local_output=True),
            "attention.wq_a": Replicated(), "attention.q_norm": Replicated(), "attention.wq_b": ColwiseParallel(),
            "attention.kv": Replicated(sum_grad_columns=head_dim), "attention.sdpa": ShardedByHead(),
            "attention.wo_a": ShardedByHead(), "attention.wo_b": RowwiseParallel(output_layouts=Shard(1))}

    def of(block) -> dict:
        attention = block.attention
        extra = {}
        if attention.compressor is not None:
            extra["attention.compressor"] = Replicated(sum_grad_columns=head_dim)
        if attention.indexer is not None:
            # the indexer's parts replicated one by one: context parallel calls its compressor on its own
            extra.update({f"attention.indexer.{part}": Replicated() for part in ("compressor", "wq_b", "weights_proj")})
            extra["attention.head_sum"] = SummedOverRanks()
        if block.feed_forward.hash_experts is not None:  # replaces the shared plan's local_tokens("feed_forward")
            extra["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True,
                input_kwarg_layouts={"ids": Replicate()}, desired_input_kwarg_layouts={"ids": Shard(1)})
        return {**plan, **extra}
    return of


def mtp_depth_tp_plan() -> dict:
    return {"enorm": SequenceParallel(), "hnorm": SequenceParallel(), "norm": SequenceParallel(),
            **{n: SequenceParallel(use_local_output=True) for n in ("e_proj", "h_proj", "hc_head")}}


def parallelize(model, world, cfg):
    last = model.norm is not None and world.dims.tp > 1
    depths = tuple(model.mtp.values()) if getattr(model, "mtp", None) is not None else ()
    more_tp = ((model, {"hc_head": SequenceParallel(use_local_output=True)}),) if last else ()
    model = parallelize_decoder(model, world, cfg, block_tp_plan(model.args.head_dim), FAMILY.high_precision, depths,
                                not cfg.deepseek_v4.mtp_loss_weight,
                                more_blocks={str(k): d.block for k, d in enumerate(depths)},
                                more_tp=(*more_tp, *((d, mtp_depth_tp_plan()) for d in depths)))
    split_lookahead(model, world)
    return model
