"""Llama 4 (text; Scout, Maverick): chunked attention on RoPE layers (q/k L2-normed after RoPE) interleaved with
full-attention NoPE layers (temperature-tuned queries), and a top-1 sigmoid MoE with one shared expert, weighting
the expert's input, in every layer or every other one."""

from tessera.models.common.counts import check_decoder_layout
from tessera.models.contract import Counts, Family
from tessera.models.llama4 import hf
from tessera.models.llama4.args import FLAVORS, TAKES_TOKENIZER_VOCAB


def counts(args, seq_len: int) -> Counts:
    """Training FLOPs per token: 6 per weight a token meets, plus attention scores and values, 12 H D_head per
    key it sees (S on NoPE layers, the chunk on chunked ones; causal masking not discounted)."""
    a, d = args, args.dim
    sparse = len(a.moe.layers)
    expert = 3 * d * a.moe_hidden
    common = a.n_layers * (d * a.head_dim * 2 * (a.n_heads + a.n_kv_heads) + 2 * d) + d \
        + (a.n_layers - sparse) * 3 * d * a.ffn_hidden + sparse * (d * a.n_experts + expert)  # router, shared expert
    table = a.vocab_size * d
    embedding = 0 if a.tie_embeddings else table
    params = table + embedding + common + sparse * a.n_experts * expert
    active = table + embedding + common + sparse * a.top_k * expert
    keys = sum(min(a.chunk, seq_len) if a.chunked(i) else seq_len for i in range(a.n_layers))
    flops = 6 * (active - embedding) + 12 * a.n_heads * a.head_dim * keys
    return Counts(params=params, active=active, embedding=embedding, flops_per_token=flops)


FAMILY = Family(name="llama4", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_decoder_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router"), torch_side="tessera.models.llama4.spec:SPEC",
                hf_model_type="llama4_text")
