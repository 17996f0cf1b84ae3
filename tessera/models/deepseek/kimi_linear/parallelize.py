"""Kimi Linear's parallelism plan: the shared decoder's. Under TP an MLA block is DeepSeek V3's
(tessera/models/deepseek/plan.py); a KDA block splits its heads: q, k, v, beta and the gates' second
low-rank projections column-wise, their first ones (rank head_dim) replicated on the gathered sequence, the per-head
parameters (convolution taps, A, dt bias) by head, the output norm over each head's values like per-head q/k norms,
the out-projection row-wise. CP: all-gather or Ulysses for MLA, state passing or Ulysses for KDA
(tessera.parallel.cp.apply_cp)."""

from torch.distributed.tensor.parallel import SequenceParallel

from tessera.models.common.linear_options import apply_options, state_passing
from tessera.models.common.plan import NORMS, parallelize_decoder
from tessera.models.deepseek.kimi_linear import FAMILY
from tessera.models.deepseek.kimi_linear.model import KimiDeltaAttention
from tessera.models.deepseek.plan import mla_tp_plan
from tessera.parallel.tp import Replicated, ShardedByHead, attention_plan

KDA_TP_PLAN = {**attention_plan("attention", ("wq", "wk", "wv", "wf_b", "wb", "wg_b"), "wo", NORMS, local_input=True),
               "attention.wf_a": Replicated(), "attention.wg_a": Replicated(), "attention.heads": ShardedByHead(),
               "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True)}


def parallelize(model, world, cfg):
    apply_options(model, cfg.kimi_linear, world.device, world.rank == 0, state_passing=state_passing(world, cfg))
    mla = mla_tp_plan(model.args)
    return parallelize_decoder(model, world, cfg,
                               lambda block: KDA_TP_PLAN if isinstance(block.attention, KimiDeltaAttention) else mla,
                               FAMILY.high_precision)
