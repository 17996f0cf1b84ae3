"""Kimi Linear (`KimiLinearForCausalLM`): a hybrid of Kimi Delta Attention blocks (linear attention with a decay per
key channel) and DeepSeek V3's MLA without RoPE, DeepSeek MoE after the first dense blocks
(tessera/models/deepseek/kimi_linear/model.py)."""

from tessera.models.common.counts import check_decoder_layout, linear_act, linear_flops_per_token
from tessera.models.contract import Counts, Family
from tessera.models.deepseek.args import mla_qk_clip
from tessera.models.deepseek.counts import counts as mla_counts, mla_params
from tessera.models.deepseek.kimi_linear import hf
from tessera.models.deepseek.kimi_linear.args import FLAVORS, TAKES_TOKENIZER_VOCAB
from tessera.models.deepseek.kimi_linear.options import KimiLinearOptions, check


def kda_params(a) -> int:
    """One KDA block's mixer parameters, and the block's two norms."""
    d, dk, heads = a.dim, a.linear_head_dim, a.linear_heads
    inner = heads * dk
    projections = 3 * d * inner + 2 * (d * dk + dk * inner) + d * heads + inner * d  # q k v, 2 gates, beta, out
    return projections + 3 * inner * a.conv_kernel + heads + inner + dk + 2 * d  # taps, A, dt bias, norm


def counts(args, seq_len: int) -> Counts:
    """DeepSeek V3's counts with the KDA blocks' mixers in place of MLA: their FLOPs per token do not grow with
    the sequence (tessera.models.common.counts.linear_flops_per_token)."""
    linear = sum(args.linear(i) for i in range(args.n_layers))
    dense = mla_counts(args, seq_len)  # as if every block were MLA
    swap = linear * (kda_params(args) - mla_params(args))
    attention = 6 * linear * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
    flops = dense.flops_per_token + 6 * swap - attention + linear * linear_flops_per_token(args)
    return Counts(params=dense.params + swap, active=dense.active + swap, embedding=dense.embedding,
                  flops_per_token=flops, extra_act=linear * linear_act(args, channel_decay=True) / args.n_layers)


def check_layout(args, tp: int, cp: int, pp: int, label: str) -> None:
    """The shared decoder's needs, and under TP the KDA heads split too. Context parallelism: its method decides
    (options.check)."""
    check_decoder_layout(args, tp, 1, pp, label)
    if tp > 1 and args.linear_heads % tp:
        raise ValueError(f"parallelism.tensor_parallel_degree: {tp} does not divide the KDA heads "
                         f"({args.linear_heads}) of {label}; pick a divisor")


def param_role(name: str, shape: tuple[int, ...]) -> str | None:
    """KDA's convolution taps [channels, K] are a filter per channel, not a linear map: a vector's role."""
    return "vector" if ".attention.heads.conv_" in name else None


FAMILY = Family(name="kimi_linear", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router"), torch_side="tessera.models.deepseek.kimi_linear.spec:SPEC",
                hf_model_type=hf.MODEL_TYPE, options=KimiLinearOptions, check=check, param_role=param_role,
                qk_clip=mla_qk_clip)
