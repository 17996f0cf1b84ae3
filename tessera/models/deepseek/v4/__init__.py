"""DeepSeek V4 (`DeepseekV4ForCausalLM`): sliding-window attention over one shared key/value head with sinks,
compressed sparse (CSA) and heavily compressed (HCA) attention blocks, hyper-connected residual streams (mHC), and
DeepSeek MoE with hash routing in the first blocks (tessera/models/deepseek/v4/model.py)."""

import logging
import math

from tessera.models.common.counts import check_decoder_layout
from tessera.models.contract import Counts, Family
from tessera.models.deepseek.v4 import hf
from tessera.models.deepseek.v4.args import CSA, FLAVORS, TAKES_TOKENIZER_VOCAB
from tessera.models.deepseek.v4.options import DeepSeekV4Options
from tessera.parallel import pp_layout


def _compressor(dim: int, head_dim: int, rate: int, overlap: bool) -> int:
    width = 2 * head_dim if overlap else head_dim
    return 2 * dim * width + rate * width + head_dim


def block_params(a, layer_id: int) -> int:
    """One block's parameters but its experts' (attention, norms, hyper-connections, router, shared experts)."""
    d, hd, h, hc = a.dim, a.head_dim, a.n_heads, a.hc_mult
    attention = d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * hd + d * hd + hd + h + h * hd * a.o_lora_rank \
        + a.o_groups * a.o_lora_rank * d
    if a.rate(layer_id):
        attention += _compressor(d, hd, a.rate(layer_id), a.layer_types[layer_id] == CSA)
    if a.layer_types[layer_id] == CSA:
        attention += _compressor(d, a.index_head_dim, a.csa_rate, True) \
            + a.q_lora_rank * a.index_n_heads * a.index_head_dim + d * a.index_n_heads
    mixes = 2 * ((2 + hc) * hc * (hc * d + 1) + 3)
    return attention + 2 * d + mixes + d * a.n_experts + a.n_shared * 3 * d * a.moe_hidden


def attended(a, layer_id: int, seq_len: int) -> float:
    """Keys and entries a query attends (averaged over positions): its window, and of the compressed entries
    (seq / rate in all, half of them earlier on average) all (HCA) or the top k (CSA)."""
    keys = min(a.window, seq_len)
    rate = a.rate(layer_id)
    if rate:
        entries = seq_len / rate / 2
        keys += min(a.index_topk, entries) if a.layer_types[layer_id] == CSA else entries
    return keys


def counts(args, seq_len: int) -> Counts:
    """Training FLOPs per token: 6 per weight a token meets, plus per block 6 H (2 head_dim) x the keys and entries
    it attends (a window and compressed entries, not the sequence), plus the CSA indexers' scores over every
    earlier entry (forward only: top-k has no gradient), 2 H_i d_i seq / rate / 2. The MTP depths count as the
    blocks they hold, with their projections, norms and collapse of the streams."""
    a, d, n = args.with_depths(), args.dim, args.n_layers + args.n_mtp
    expert = 3 * d * a.moe_hidden
    table = a.vocab_size * d
    embedding = 0 if a.tie_embeddings else table
    collapse = a.hc_mult * (a.hc_mult * d + 1) + 1
    common = table + embedding + d + collapse + sum(block_params(a, i) for i in range(n)) \
        + args.n_mtp * (2 * d * d + 3 * d + collapse)
    params, active = common + n * a.n_experts * expert, common + n * a.top_k * expert
    attention = sum(6 * a.n_heads * 2 * a.head_dim * attended(a, i, seq_len) for i in range(n))
    indexers = sum(a.layer_types[i] == CSA for i in range(n))
    scoring = indexers * 2 * a.index_n_heads * a.index_head_dim * seq_len / a.csa_rate / 2
    streams = (a.hc_mult - 1) * d * 4  # the streams' extra width, around both sublayers, in and out
    return Counts(params=params, active=active, embedding=embedding,
                  flops_per_token=6 * (active - embedding) + attention + scoring, extra_act=streams)


def check_layout(args, tp: int, cp: int, pp: int, label: str) -> None:
    """TP splits the query heads (the key/value head, compressors and indexer stay whole on every rank) and
    the output projection's groups; CP's chunks are checked against the sequence in `check`."""
    check_decoder_layout(args, 1, 1, pp, label)
    for what, size in (("attention heads", args.n_heads), ("output projection's groups", args.o_groups),
                       ("vocab size", args.vocab_size)):
        if tp > 1 and size and size % tp:
            raise ValueError(f"parallelism.tensor_parallel_degree: {tp} does not divide the {what} ({size}) of "
                             f"{label}; pick a divisor")
    if tp > 1 and args.tie_embeddings:
        raise ValueError(f"parallelism.tensor_parallel_degree: {label} ties its embeddings, which tensor parallelism "
                         f"does not support yet; use FSDP (data_parallel_shard_degree) instead")


def check_cp(cfg, args, cp: int, label: str, rates: list[int]) -> None:
    """All-gather CP: each chunk reads the window before it from the chunk before and compresses its own windows,
    so a chunk holds at least the window and whole windows of every rate. Ulysses is refused: its head split
    cannot share out one key/value head and entries that span the sequence."""
    if cfg.parallelism.context_parallel_method == "ulysses":
        raise ValueError(f"parallelism.context_parallel_method: {label}'s one key/value head serves every query head "
                         f"and its compressed entries span the sequence, which Ulysses' head split cannot share out; "
                         f"use \"allgather\"")
    chunk = cfg.training.seq_len // (2 * cp)
    if chunk < args.window or any(chunk % r for r in rates):
        whole = math.lcm(*rates) if rates else 1
        raise ValueError(f"parallelism.context_parallel_degree: all-gather CP {cp} cuts each sequence into {2 * cp} "
                         f"chunks of {chunk} tokens, and {label}'s chunks must hold its window ({args.window} tokens) "
                         f"and whole windows of its compression rates {rates}; set training.seq_len to a multiple of "
                         f"{2 * cp * whole} of at least {2 * cp * max(args.window, whole)}, or lower the CP degree")


def check(cfg, args, dims) -> None:
    """The sequence against the compression rates and the indexer's top-k (warnings: short runs run); hash
    routing's table against EP and the pipeline's first stage (the only one that holds token ids); MTP under PP
    with TP (as DeepSeek V3's)."""
    label, seq = f"{cfg.model.name} {cfg.model.flavor or 'model'}", cfg.training.seq_len
    rates = sorted({args.rate(i) for i in range(args.n_layers)} - {0})
    log = logging.getLogger("tessera")
    if dims.cp > 1:
        check_cp(cfg, args, dims.cp, label, rates)
    if any(seq % r for r in rates):  # a smoke run on short sequences runs: its last tokens are not compressed
        log.warning(f"training.seq_len: {seq} tokens is not a multiple of {label}'s compression rates {rates} "
                    f"(tokens per compressed entry): the last {seq % max(rates)} or fewer make no entry")
    if CSA in args.layer_types and args.index_topk >= seq // args.csa_rate:
        log.warning(
            f"training.seq_len: {seq} tokens make {seq // args.csa_rate} CSA entries, and {label} attends the top "
            f"{args.index_topk} (index_topk): every entry, so its sparse attention computes as dense here")
    if args.n_mtp and cfg.deepseek_v4.mtp_loss_weight and dims.pp > 1 and dims.tp > 1:
        raise ValueError("deepseek_v4.mtp_loss_weight: under pipelining the MTP depths take the first stage's "
                         "embeddings of whole sequences, which TP ranks do not hold; with PP, use FSDP/EP only, or set "
                         "it to 0 (the depths stay in the model and its checkpoints, untrained)")
    if cfg.lora.rank and "wo_a" in cfg.lora.target_modules:
        raise ValueError(f"lora.target_modules: wo_a is {label}'s grouped output projection (a block-diagonal map), "
                         f"which LoRA's adapters do not take; adapt wo_b instead")
    hashed = [i for i in range(args.n_layers) if args.hashed(i)]
    if hashed and dims.ep > 1 and args.n_experts % dims.ep:
        raise ValueError(f"parallelism.expert_parallel_degree: {dims.ep} does not divide the {args.n_experts} experts "
                         f"that {label}'s hash routing table deals tokens to; pick a divisor")
    if hashed and dims.pp > 1:
        p = cfg.parallelism
        less = (p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers)
        stages = pp_layout.num_stages(args.n_layers, dims.pp, p.pipeline_parallel_schedule,
                                      p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_split_points, *less)
        first = pp_layout.stage_layers(args.n_layers, stages, p.pipeline_parallel_split_points, *less)[0]
        if set(hashed) - set(first):
            raise ValueError(f"parallelism.pipeline_parallel_degree: {label}'s hash-routed blocks {hashed} read the "
                             f"token ids, which only the first stage holds, and it holds blocks {first}; give it more "
                             f"(pipeline_parallel_split_points or _layers_per_stage)")


def param_role(name: str, shape: tuple[int, ...]) -> str | None:
    """The hyper-connections' mixing weights and the compressors' slot biases are small per-position tables, not
    linear maps a spectral optimizer should orthogonalize: vectors."""
    return "vector" if name.endswith(("_hc.fn", "hc_head.fn", ".ape")) else None


FAMILY = Family(name="deepseek_v4", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router", "wo_a"),
                torch_side="tessera.models.deepseek.v4.spec:SPEC", hf_model_type=hf.MODEL_TYPE, check=check,
                param_role=param_role, options=DeepSeekV4Options, metrics={"mtp_loss": "mtp", "indexer_loss": "idx"},
                trains_absent_parts=lambda cfg: cfg.deepseek_v4.mtp_loss_weight > 0)
