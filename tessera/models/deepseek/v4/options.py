"""DeepSeek V4's own options, the [deepseek_v4] section of a config (Family.options)."""

from dataclasses import dataclass

from tessera.config.sections import opt


@dataclass
class DeepSeekV4Options:
    indexer_loss_weight: float = opt(1.0, "weight of the CSA blocks' indexer loss: KL of its scores to the heads' "
                                     "attention over the compressed entries it picked (each block's mean over its "
                                     "queries); 0: the indexer does not train", min=0.0)
