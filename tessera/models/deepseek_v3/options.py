"""DeepSeek V3's own options, the [deepseek_v3] section of a config, and their check (Family.options, .check)."""

from dataclasses import dataclass

from tessera.config.sections import opt


@dataclass
class DeepSeekV3Options:
    mtp_loss_weight: float = opt(0.3, "weight of the multi-token prediction loss (the mean over depths), for flavors "
                                 "with MTP depths (DeepSeek V3: 0.3, later 0.1); 0 = the depths are kept but not run",
                                 min=0.0)


def check(cfg, args, dims) -> None:
    if getattr(args, "n_mtp", 0) and cfg.deepseek_v3.mtp_loss_weight and (dims.tp > 1 or dims.cp > 1):
        raise ValueError("deepseek_v3.mtp_loss_weight: multi-token prediction runs on whole sequences, after the "
                         "last block and beside the input embedding, which TP and CP ranks do not hold yet; set "
                         "it to 0 there (the depths stay in the model and its checkpoints, untrained)")
