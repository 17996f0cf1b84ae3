"""Qwen 3.5 MoE: Qwen 3.5's hybrid blocks (Gated DeltaNet and gated full attention), each with routed experts and a
shared expert scaled by a learned sigmoid gate."""

from tessera.models.contract import Counts, Family
from tessera.models.qwen3_5.args import param_role
from tessera.models.qwen3_5.counts import check_hybrid_layout, hybrid_counts, moe_ffn
from tessera.models.qwen3_5.moe import hf
from tessera.models.qwen3_5.moe.args import FLAVORS, TAKES_TOKENIZER_VOCAB
from tessera.models.qwen3_5.options import Qwen35Options, check as check_options


def counts(args, seq_len: int) -> Counts:
    every, active = moe_ffn(args)
    return hybrid_counts(args, seq_len, args.n_layers * every, args.n_layers * active)


def check(cfg, args, dims) -> None:
    check_options(cfg, args, dims, "qwen3_5_moe")


FAMILY = Family(name="qwen3_5_moe", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_hybrid_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router", "shared.gate"), torch_side="tessera.models.qwen3_5.moe.spec:SPEC",
                hf_model_type=hf.MODEL_TYPE, options=Qwen35Options, check=check, param_role=param_role)
