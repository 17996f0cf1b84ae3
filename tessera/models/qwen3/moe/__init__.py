"""Qwen 3 MoE: Qwen 3's attention with a mixture of experts (tessera.models.common.moe) in any pattern of blocks."""

from tessera.models.common.counts import check_decoder_layout, decoder_counts
from tessera.models.contract import Counts, Family
from tessera.models.qwen3.moe import hf
from tessera.models.qwen3.moe.args import FLAVORS, TAKES_TOKENIZER_VOCAB


def counts(args, seq_len: int) -> Counts:
    """The shared decoder's counts (one SwiGLU of ffn_hidden per block) with the blocks that have experts
    (args.moe.layers) swapping theirs for a router and E experts (top_k active)."""
    dense = decoder_counts(args, seq_len)
    swiglu, expert = 3 * args.dim * args.ffn_hidden, 3 * args.dim * args.moe_hidden
    router, sparse = args.dim * args.n_experts, len(args.moe.layers)
    total = dense.params + sparse * (router + args.n_experts * expert - swiglu)
    active = dense.params + sparse * (router + args.top_k * expert - swiglu)
    flops = dense.flops_per_token + 6 * sparse * (router + args.top_k * expert - swiglu)
    return Counts(params=total, active=active, embedding=dense.embedding, flops_per_token=flops)


FAMILY = Family(name="qwen3_moe", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_decoder_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router"), torch_side="tessera.models.qwen3.moe.spec:SPEC",
                hf_model_type="qwen3_moe")
