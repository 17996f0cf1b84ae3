"""Parameter and FLOP counts of the DeepSeek group's decoders (MLA and DeepSeek MoE; MTP depths; V3.2's indexer).
Torch-free."""

from tessera.models.contract import Counts


def mla_params(a) -> int:
    """One MLA block's attention parameters, and the block's two norms."""
    d = a.dim
    q = d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.n_heads * a.head_dim if a.q_lora_rank \
        else d * a.n_heads * a.head_dim
    kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank \
        + a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + a.n_heads * a.v_head_dim * d + 2 * d


def counts(args, seq_len: int) -> Counts:
    """Training FLOPs per token: 6 per weight a token meets, plus attention scores and values over MLA's
    head sizes, 6 L H (qk + v) S (causal masking not discounted). MTP depths count as blocks (they train).
    DeepSeek V3.2 (index_topk): each query attends min(S, top-k) keys, and its indexer scores all S of them (6 H_i
    d_i S; its projections are weights), in each block with an indexer (GLM-5's shared blocks have none)."""
    a, d = args, args.dim
    attention = mla_params(a)
    indexed = (a.n_layers + a.n_mtp - len(a.index_shared)) if a.index_topk else 0
    indexer = a.q_lora_rank * a.index_n_heads * a.index_head_dim + d * a.index_head_dim + 2 * a.index_head_dim \
        + d * a.index_n_heads  # wq_b, wk, its LayerNorm, weights_proj
    expert, sparse = 3 * d * a.moe_hidden, a.n_layers - a.first_k_dense
    moe = d * a.n_experts + a.n_shared * expert
    table = a.vocab_size * d
    embedding = 0 if a.tie_embeddings else table
    sparse += a.n_mtp  # each MTP depth: a MoE block, its 3 norms and the projection of [embedding; hidden]
    blocks = (a.n_layers + a.n_mtp) * attention + indexed * indexer + a.n_mtp * (3 * d + 2 * d * d)
    common = table + embedding + d + blocks + a.first_k_dense * 3 * d * a.ffn_hidden + sparse * moe
    params, active = common + sparse * a.n_experts * expert, common + sparse * a.top_k * expert
    keys = min(seq_len, a.index_topk) if a.index_topk else seq_len
    flops = 6 * (active - embedding) + 6 * (a.n_layers + a.n_mtp) * a.n_heads * (a.head_dim + a.v_head_dim) * keys \
        + 6 * indexed * a.index_n_heads * a.index_head_dim * seq_len
    return Counts(params=params, active=active, embedding=embedding, flops_per_token=flops)
