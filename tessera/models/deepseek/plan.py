"""The DeepSeek group's TP plan of MLA blocks (DeepSeek V3's and Kimi Linear's): TP splits MLA by heads, the query's
(last) projection and the latent's expansion to per-head keys and values column-wise, the output row-wise; the query
bottleneck, the latent and their norms stay replicated and run on the gathered sequence. The rope key is one head
that every rank's heads use, so each rank's gradient of it is partial: summed over TP where it leaves `wkv_a`."""

from tessera.models.common.plan import NORMS
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
