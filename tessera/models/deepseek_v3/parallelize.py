"""DeepSeek V3's parallelism plan: the shared decoder's, with MLA's attention under TP.

TP splits MLA by heads: the query's (last) projection and the latent's expansion to per-head keys and values
are column-wise, the output row-wise; the query bottleneck, the latent and their norms stay replicated and run
on the gathered sequence. The rope key is one head that every rank's heads use, so each rank's gradient of it
is partial: summed over TP where it leaves `wkv_a`. CP swaps the kernel, keeping MLA's score scale. The MTP
depths (the last stage's) are FSDP units of their own; they train only without TP/CP (checked at launch)."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.plan import NORMS, parallelize_decoder
from tessera.models.deepseek_v3 import FAMILY
from tessera.parallel.tp import Replicated, attention_plan


def mla_tp_plan(args) -> dict:
    query = "wq_b" if args.q_lora_rank else "wq"
    replicated = ("wq_a", "q_norm", "kv_norm") if args.q_lora_rank else ("kv_norm",)
    return {**attention_plan("attention", (query, "wkv_b"), "wo", NORMS, local_input=True),
            **{f"attention.{name}": Replicated() for name in replicated},
            "attention.wkv_a": Replicated(sum_grad_columns=args.qk_rope_head_dim)}


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    depths = tuple(model.mtp.values()) if getattr(model, "mtp", None) is not None else ()
    return parallelize_decoder(model, world, cfg, mla_tp_plan(model.args), FAMILY.high_precision, depths,
                               not cfg.deepseek_v3.mtp_loss_weight)
