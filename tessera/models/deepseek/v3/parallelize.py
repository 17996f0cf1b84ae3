"""DeepSeek V3's parallelism plan: the shared decoder's, with MLA's attention under TP.

TP splits MLA by heads (tessera/models/deepseek/plan.py). CP swaps the kernel, keeping MLA's score scale.

The MTP depths (the last stage's) are FSDP units of their own. Each runs on the whole sequence (its slot i holds
token i + k), so TP and CP split it like the trunk: its block takes the blocks' plan; its norms and its
projection of [embedding; hidden] run on each rank's sequence slice with replicated weights (sequence parallel,
their gradients summed over TP). Under CP the lookahead that shifts each depth's tokens, positions, documents
and targets reads across the ranks' chunks; under DP and CP it counts a depth's trained targets over their ranks.
Under PP the depths sit on the last stage, fed the first stage's embeddings through the stages
(model.carries_embeddings)."""

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from tessera.distributed import World
from tessera.models.common.plan import parallelize_decoder
from tessera.models.deepseek.plan import mla_tp_plan, split_lookahead
from tessera.models.deepseek.v3 import FAMILY
from tessera.models.deepseek.v3.options import DeepSeekV3Config


def mtp_depth_tp_plan() -> dict:
    """A depth's own modules (its block takes the blocks' plan): sequence parallel; the projection hands its
    block a plain sequence slice, as the embedding hands the first block."""
    return {"enorm": SequenceParallel(), "hnorm": SequenceParallel(), "norm": SequenceParallel(),
            "eh_proj": SequenceParallel(use_local_output=True)}


def parallelize(model: nn.Module, world: World, cfg: DeepSeekV3Config) -> nn.Module:
    depths = tuple(model.mtp.values()) if getattr(model, "mtp", None) is not None else ()
    untrained = not cfg.deepseek_v3.mtp_loss_weight
    model = parallelize_decoder(model, world, cfg, mla_tp_plan(model.args), FAMILY.high_precision, depths, untrained,
                                more_blocks={str(k): d.block for k, d in enumerate(depths)},
                                more_tp=tuple((d, mtp_depth_tp_plan()) for d in depths))
    split_lookahead(model, world)
    return model
