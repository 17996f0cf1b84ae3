"""DeepSeek V4's own options, the [deepseek_v4] section of a config (Family.options)."""

from dataclasses import dataclass

from tessera.config.sections import opt


@dataclass
class DeepSeekV4Options:
    mtp_loss_weight: float = opt(0.3, "weight of the multi-token prediction loss (the mean over depths), for models "
                                 "with MTP depths (the releases' one, debugmodel_mtp's two); 0 = the depths are kept "
                                 "but not run", min=0.0)
    indexer_loss_weight: float = opt(1.0, "weight of the CSA blocks' indexer loss: KL of its scores to the heads' "
                                     "attention over the compressed entries it picked (each block's mean over its "
                                     "queries); 0: the indexer does not train", min=0.0)
