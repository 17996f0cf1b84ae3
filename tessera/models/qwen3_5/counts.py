"""Parameter and FLOP counts of Qwen 3.5's hybrid decoder (tessera/models/qwen3_5/model.py), and what
its layouts need. Torch-free."""

from tessera.models.common.counts import check_decoder_layout, linear_act, linear_flops_per_token
from tessera.models.contract import Counts


def deltanet_params(a) -> int:
    qk, v = a.linear_k_heads * a.linear_k_dim, a.linear_v_heads * a.linear_v_dim
    return a.dim * (2 * qk + v) + a.dim * v + 2 * a.dim * a.linear_v_heads + (2 * qk + v) * a.conv_kernel \
        + 2 * a.linear_v_heads + a.linear_v_dim + v * a.dim


def attention_params(a) -> int:
    return a.dim * a.head_dim * (3 * a.n_heads + 2 * a.n_kv_heads) + 2 * a.head_dim


def moe_ffn(args) -> tuple[int, int]:
    """One MoE block's FFN (all of it, what a token uses): a router, E experts (top_k active), the shared expert
    and its gate."""
    expert = 3 * args.dim * args.moe_hidden
    common = args.dim * args.n_experts + 3 * args.dim * args.shared_hidden + args.dim
    return common + args.n_experts * expert, common + args.top_k * expert


def hybrid_counts(args, seq_len: int, ffn_params: int, ffn_active: int) -> Counts:
    """`ffn_params`/`ffn_active`: the FFNs of all blocks together, all of them and what one token uses. Attention
    FLOPs grow with the sequence only in the full-attention blocks (12 H hd S each); a DeltaNet block's are
    constant per token."""
    linear = sum(args.linear(i) for i in range(args.n_layers))
    full = args.n_layers - linear
    mixers = linear * deltanet_params(args) + full * attention_params(args)
    table = args.vocab_size * args.dim
    embedding = 0 if args.tie_embeddings else table
    common = table + embedding + args.dim + mixers + args.n_layers * 2 * args.dim
    params, active = common + ffn_params, common + ffn_active
    flops = 6 * (active - embedding) + 12 * full * args.n_heads * args.head_dim * seq_len \
        + linear * linear_flops_per_token(args)
    return Counts(params=params, active=active, embedding=embedding, flops_per_token=flops,
                  extra_act=linear * linear_act(args) / args.n_layers)


def check_hybrid_layout(args, tp: int, cp: int, pp: int, label: str) -> None:
    """The shared decoder's needs, and under TP DeltaNet's key and value heads split too. Context parallelism: its
    method decides (tessera.models.qwen3_5.options.check)."""
    check_decoder_layout(args, tp, 1, pp, label)
    for what, size in (("DeltaNet key heads", args.linear_k_heads), ("DeltaNet value heads", args.linear_v_heads)):
        if tp > 1 and size % tp:
            raise ValueError(f"parallelism.tensor_parallel_degree: {tp} does not divide the {what} ({size}) of "
                             f"{label}; pick a divisor")
