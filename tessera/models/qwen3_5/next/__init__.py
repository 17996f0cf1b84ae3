"""Qwen3-Next (`Qwen3NextForCausalLM`): Qwen 3.5's hybrid blocks (Gated DeltaNet and gated full attention), a
mixture of experts with a gated shared expert in every decoder_sparse_step-th block (a SwiGLU in the others and
in mlp_only_layers), routing weights renormalized when norm_topk_prob; DeltaNet's projections fused per key head
in its Hugging Face layout (hf.py)."""

from tessera.models.contract import Counts, Family
from tessera.models.qwen3_5.args import param_role
from tessera.models.qwen3_5.counts import check_hybrid_layout, hybrid_counts, moe_ffn
from tessera.models.qwen3_5.next import hf
from tessera.models.qwen3_5.next.args import FLAVORS, TAKES_TOKENIZER_VOCAB
from tessera.models.qwen3_5.options import Qwen35Options, check as check_options


def counts(args, seq_len: int) -> Counts:
    sparse, dense = len(args.sparse_layers), args.n_layers - len(args.sparse_layers)
    every, active = moe_ffn(args)
    swiglu = 3 * args.dim * args.ffn_hidden
    return hybrid_counts(args, seq_len, sparse * every + dense * swiglu, sparse * active + dense * swiglu)


def check(cfg, args, dims) -> None:
    check_options(cfg, args, dims, "qwen3_next")


FAMILY = Family(name="qwen3_next", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_hybrid_layout, embedding="tok_embeddings.weight",
                high_precision=("output", "router", "shared.gate"), torch_side="tessera.models.qwen3_5.next.spec:SPEC",
                hf_model_type=hf.MODEL_TYPE, options=Qwen35Options, check=check, param_role=param_role)
