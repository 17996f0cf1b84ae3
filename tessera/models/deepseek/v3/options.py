"""DeepSeek V3's own options, the [deepseek_v3] section of a config, and their check (Family.options, .check)."""

from dataclasses import dataclass

from tessera.config.sections import JobConfig, opt


@dataclass
class DeepSeekV3Options:
    mtp_loss_weight: float = opt(0.3, "weight of the multi-token prediction loss (the mean over depths), for flavors "
                                 "with MTP depths (DeepSeek V3: 0.3, later 0.1); 0 = the depths are kept but not run",
                                 min=0.0)


class DeepSeekV3Config(JobConfig):
    """The whole config as DeepSeek V3's code reads it (a type for readers and checkers, never built: the schema,
    tessera.schema, mounts DeepSeekV3Options as the `deepseek_v3` section of the one JobConfig)."""
    deepseek_v3: DeepSeekV3Options


def check(cfg: DeepSeekV3Config, args, dims) -> None:
    if getattr(args, "n_mtp", 0) and cfg.deepseek_v3.mtp_loss_weight and dims.pp > 1 and (dims.tp > 1 or dims.cp > 1):
        raise ValueError("deepseek_v3.mtp_loss_weight: under pipelining the MTP depths take the first stage's "
                         "embeddings of whole sequences, which TP and CP ranks do not hold; with PP, use FSDP/EP "
                         "only, or set it to 0 (the depths stay in the model and its checkpoints, untrained)")
