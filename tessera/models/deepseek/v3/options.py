"""DeepSeek V3's own options, the [deepseek_v3] section of a config, and their check (Family.options, .check)."""

import logging
from dataclasses import dataclass

from tessera.config.sections import JobConfig, opt


@dataclass
class DeepSeekV3Options:
    mtp_loss_weight: float = opt(0.3, "weight of the multi-token prediction loss (the mean over depths), for flavors "
                                 "with MTP depths (DeepSeek V3: 0.3, later 0.1); 0 = the depths are kept but not run",
                                 min=0.0)
    indexer_loss_weight: float = opt(1.0, "DeepSeek V3.2 (flavors with index_topk): weight of the indexer's KL loss "
                                     "to the main attention's distribution (each layer's mean over its queries)",
                                     min=0.0)
    dense_warmup_steps: int = opt(0, "DeepSeek V3.2: the first steps attend every key (dense) while the indexer is "
                                  "fitted to them; sparse after (V3.2: 1000, from a V3.1 checkpoint)", min=0)
    dense_warmup_trains: str = opt("all", "DeepSeek V3.2: what trains during the dense warm-up: all (the model on "
                                   "its loss and the indexer on its own) or indexer (the indexers alone, the rest "
                                   "kept as loaded, as the V3.2 report does from a V3.1 checkpoint)",
                                   choices=("all", "indexer"))


class DeepSeekV3Config(JobConfig):
    """The whole config as DeepSeek V3's code reads it (a type for readers and checkers, never built: the schema,
    tessera.schema, mounts DeepSeekV3Options as the `deepseek_v3` section of the one JobConfig)."""
    deepseek_v3: DeepSeekV3Options


def check(cfg: DeepSeekV3Config, args, dims) -> None:
    if getattr(args, "index_topk", 0):
        check_sparse(cfg, args, dims)
    elif cfg.deepseek_v3.dense_warmup_trains == "indexer":
        raise ValueError(f"deepseek_v3.dense_warmup_trains: {cfg.model.name} {cfg.model.flavor or 'model'} has no "
                         f"indexer (sparse attention: index_topk); set it to \"all\"")
    if getattr(args, "n_mtp", 0) and cfg.deepseek_v3.mtp_loss_weight and dims.pp > 1 and (dims.tp > 1 or dims.cp > 1):
        raise ValueError("deepseek_v3.mtp_loss_weight: under pipelining the MTP depths take the first stage's "
                         "embeddings of whole sequences, which TP and CP ranks do not hold; with PP, use FSDP/EP "
                         "only, or set it to 0 (the depths stay in the model and its checkpoints, untrained)")


def in_dense_warmup(cfg: DeepSeekV3Config, step: int) -> bool:
    """Whether optimizer step `step` (from 0) is one of the dense warm-up's: what both its switches read."""
    return step < cfg.deepseek_v3.dense_warmup_steps


def trains_only(cfg: DeepSeekV3Config, step: int) -> tuple[str, ...] | None:
    """Family.trains_only: the indexers alone during an indexer-only dense warm-up."""
    return ("indexer.",) if cfg.deepseek_v3.dense_warmup_trains == "indexer" and in_dense_warmup(cfg, step) else None


def begin_step(model, cfg: DeepSeekV3Config, step: int) -> None:
    """ModelSpec.begin_step: the dense warm-up's switch, on in its steps (a pipeline stage takes it too)."""
    model.attend_every_key(in_dense_warmup(cfg, step))


def check_sparse(cfg: DeepSeekV3Config, args, dims) -> None:
    """DeepSeek V3.2's sparse attention: top-k of a sequence, and layouts that hold each query's every key and all
    heads (the indexer's loss is fitted to the heads' summed attention)."""
    label = f"{cfg.model.name} {cfg.model.flavor or 'model'}"
    if args.index_topk >= cfg.training.seq_len:  # a smoke run on short sequences runs: the attention is dense
        logging.getLogger("tessera").warning(
            f"training.seq_len: {cfg.training.seq_len} tokens, and {label} attends the top {args.index_topk} keys "
            f"(index_topk): every key, so its sparse attention computes as dense attention here")
    warmup = cfg.deepseek_v3.dense_warmup_steps
    if warmup >= cfg.training.steps:  # a run that is all warm-up is legitimate (the V3.2 report's stage one)
        alone = ", the indexers alone trained" if cfg.deepseek_v3.dense_warmup_trains == "indexer" else ""
        logging.getLogger("tessera").warning(
            f"deepseek_v3.dense_warmup_steps: {warmup}, and training.steps is {cfg.training.steps}: every step of "
            f"this run is the dense warm-up (every key attended{alone}), so {label} never trains sparse; set it below "
            f"training.steps to train the sparse attention")
    if args.index_shared and dims.pp > 1:
        raise ValueError(f"parallelism.pipeline_parallel_degree: {label}'s blocks {args.index_shared} attend the keys "
                         f"an earlier block picked, which may sit on another stage; not yet under PP")
    if dims.cp > 1 and cfg.parallelism.context_parallel_method == "ulysses":
        raise ValueError(f"parallelism.context_parallel_method: {label}'s sparse attention (DSA) picks each query's "
                         f"keys with an indexer of one head, which Ulysses' head split cannot share out; use "
                         f"\"allgather\" (each rank gathers the keys' latent and the indexer's keys)")
