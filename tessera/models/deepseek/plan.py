"""The DeepSeek group's TP plan of MLA blocks (DeepSeek V3's and Kimi Linear's): TP splits MLA by heads, the query's
(last) projection and the latent's expansion to per-head keys and values column-wise, the output row-wise; the query
bottleneck, the latent and their norms stay replicated and run on the gathered sequence. The rope key is one head
that every rank's heads use, so each rank's gradient of it is partial: summed over TP where it leaves `wkv_a`.
And the lookahead of the group's multi-token prediction depths when ranks split a micro-batch's tokens."""

from torch import nn

from tessera.distributed import World
from tessera.models.common.plan import NORMS
from tessera.parallel.cp import SplitLookahead
from tessera.parallel.tp import Replicated, SummedOverRanks, attention_plan


def mla_tp_plan(args):
    """The blocks' plan; with sparse attention (DSA) a block's: its indexer replicated (each rank scores every key
    for every query, the same top-k), the attention probabilities its loss is fitted to summed over the ranks'
    heads."""
    query = "wq_b" if args.q_lora_rank else "wq"
    replicated = ("wq_a", "q_norm", "kv_norm") if args.q_lora_rank else ("kv_norm",)
    plan = {**attention_plan("attention", (query, "wkv_b"), "wo", NORMS, local_input=True),
            **{f"attention.{name}": Replicated() for name in replicated},
            "attention.wkv_a": Replicated(sum_grad_columns=args.qk_rope_head_dim)}
    if not args.index_topk:
        return plan
    return lambda block: {**plan, **({"attention.indexer": Replicated(), "attention.head_sum": SummedOverRanks()}
                                     if block.attention.indexer is not None else {})}


def split_lookahead(model: nn.Module, world: World) -> None:
    """Under data or context parallelism, the MTP depths' lookahead reads ahead across CP's chunks and counts a
    depth's trained targets over every rank of the micro-batch (tessera.parallel.cp.SplitLookahead): its loss is
    then the micro-batch's mean, as in one process, however the ranks' shares of the targets differ."""
    dims = world.dims
    if getattr(model, "mtp", None) is not None and dims.dp * dims.cp > 1:
        model.lookahead = SplitLookahead(model.lookahead, world.flat["dp_cp"].get_group(), dims.dp * dims.cp,
                                         world.mesh["cp"] if dims.cp > 1 else None)
