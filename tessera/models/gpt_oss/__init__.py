"""GPT-OSS (20b, 120b): attention sinks, alternating sliding-window layers, a biased MoE with the clamped SwiGLU."""

from tessera.models.common.counts import check_decoder_layout
from tessera.models.contract import Counts, Family
from tessera.models.gpt_oss import hf
from tessera.models.gpt_oss.args import FLAVORS, TAKES_TOKENIZER_VOCAB


def counts(args, seq_len: int) -> Counts:
    """Training FLOPs per token: 6 per weight a token meets, plus attention scores and values, 12 H D_head per
    key it sees (S on full layers, the window on sliding ones; causal masking not discounted)."""
    a, d, hd = args, args.dim, args.head_dim
    attention = d * hd * (2 * a.n_heads + 2 * a.n_kv_heads) + hd * (a.n_heads + 2 * a.n_kv_heads) + d + a.n_heads
    expert = 3 * d * a.moe_hidden + 2 * a.moe_hidden + d
    common = a.n_layers * (attention + 2 * d + d * a.n_experts + a.n_experts) + d
    table = a.vocab_size * d
    embedding = 0 if a.tie_embeddings else table
    params = table + embedding + common + a.n_layers * a.n_experts * expert
    active = table + embedding + common + a.n_layers * a.top_k * expert
    keys = sum(min(a.window, seq_len) if a.sliding(i) else seq_len for i in range(a.n_layers))
    flops = 6 * (active - embedding) + 12 * a.n_heads * hd * keys
    return Counts(params=params, active=active, embedding=embedding, flops_per_token=flops)


FAMILY = Family(name="gpt_oss", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_decoder_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router"), torch_side="tessera.models.gpt_oss.spec:SPEC",
                hf_model_type="gpt_oss")
