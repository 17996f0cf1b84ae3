"""Parameter and FLOP counts of the shared decoder (tessera.models.common.decoder), from its args alone."""

from tessera.models.contract import Counts

CHUNK = 64  # the chunked linear-attention rule's default chunk, for its FLOPs


def decoder_counts(args, seq_len: int) -> Counts:
    """Training FLOPs per token: 6 per weight a token meets (forward 2, backward 4), plus attention scores and
    values, 12 L H D_head S (causal masking not discounted, as in the PaLM paper)."""
    d, hd = args.dim, args.head_dim
    attention = d * hd * (2 * args.n_heads + 2 * args.n_kv_heads) + (2 * hd if args.qk_norm else 0)
    block = attention + 3 * d * args.ffn_hidden + 2 * d
    table = args.vocab_size * d
    params = table + args.n_layers * block + d + (0 if args.tie_embeddings else table)
    embedding = 0 if args.tie_embeddings else table
    flops = 6 * (params - embedding) + 12 * args.n_layers * args.n_heads * hd * seq_len
    return Counts(params=params, active=params, embedding=embedding, flops_per_token=flops)


def check_decoder_layout(args, tp: int, cp: int, pp: int, label: str) -> None:
    """What tensor and pipeline parallelism need of the shared decoder (context parallelism it takes at any
    degree the sequence splits into). A vocabulary of 0 is not known yet (the tokenizer's): checked once it is."""
    if tp > 1:
        moe = getattr(args, "moe", None)
        dense = moe is None or moe.n_sparse(args.n_layers) < args.n_layers  # blocks with a SwiGLU that TP splits
        for what, size in (("attention heads", args.n_heads), ("KV heads", args.n_kv_heads),
                           ("FFN hidden size", args.ffn_hidden if dense else 0), ("vocab size", args.vocab_size)):
            if size and size % tp:
                raise ValueError(f"parallelism.tensor_parallel_degree: {tp} does not divide the {what} ({size}) "
                                 f"of {label}; pick a divisor")
        if args.tie_embeddings:
            raise ValueError(f"parallelism.tensor_parallel_degree: {label} ties its embeddings, which tensor "
                             f"parallelism does not support yet; use FSDP (data_parallel_shard_degree) instead")
    if pp > 1 and args.tie_embeddings:
        raise ValueError(f"parallelism.pipeline_parallel_degree: {label} ties its embeddings across the first and "
                         f"last stage, which pipelining does not support; use FSDP/TP instead")


def linear_flops_per_token(a, chunk: int = CHUNK) -> float:
    """Training FLOPs of one linear-attention layer's recurrence per token (Gated DeltaNet, KDA; `a` names its
    heads and sizes as linear_v_heads, linear_k_dim, linear_v_dim) (its projections are counted as weights):
    per value head, the state's read, correction and write (3 dk dv) and the chunk's intra-chunk products
    (chunk (2 dk + 2 dv)), 2 per multiply-add, times 3 for backward. Independent of the sequence's length."""
    dk, dv = a.linear_k_dim, a.linear_v_dim
    return 6 * a.linear_v_heads * (3 * dk * dv + chunk * (2 * dk + 2 * dv))


def linear_act(a, chunk: int = CHUNK, channel_decay: bool = False) -> float:
    """Elements (2-byte) a chunked linear-attention layer's forward keeps per token for backward, counted low (about
    half of what a Gated DeltaNet layer traced at Qwen 3.5 35B-A3B's shape keeps): per value head, in fp32, the
    state entering each chunk (dk dv / chunk a token); q, k, k * beta, the solved w, the decayed q and k (dk each);
    v, the solved u, the corrections (dv each); the chunk's decay, attention and triangular system rows (chunk
    each). `channel_decay` (KDA's torch path): the decay between each pair of the chunk's tokens per key channel,
    chunk dk more."""
    dk, dv = a.linear_k_dim, a.linear_v_dim
    return 2 * a.linear_v_heads * (dk * dv / chunk + 6 * dk + 3 * dv + 3 * chunk + (chunk * dk if channel_decay else 0))
