"""Qwen 3.5 dense: a hybrid decoder of Gated DeltaNet (linear attention) blocks and gated full-attention blocks
(tessera/models/qwen3_5/model.py)."""

from tessera.models.contract import Counts, Family
from tessera.models.qwen3_5.args import param_role
from tessera.models.qwen3_5.counts import check_hybrid_layout, hybrid_counts
from tessera.models.qwen3_5.dense import hf
from tessera.models.qwen3_5.dense.args import FLAVORS, TAKES_TOKENIZER_VOCAB
from tessera.models.qwen3_5.options import Qwen35Options, check


def counts(args, seq_len: int) -> Counts:
    swiglu = args.n_layers * 3 * args.dim * args.ffn_hidden
    return hybrid_counts(args, seq_len, swiglu, swiglu)


FAMILY = Family(name="qwen3_5", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=counts, check_layout=check_hybrid_layout, embedding="tok_embeddings.weight",
                high_precision=("output",), torch_side="tessera.models.qwen3_5.dense.spec:SPEC",
                hf_model_type=hf.MODEL_TYPE, options=Qwen35Options, check=check, param_role=param_role)
