"""Qwen 3 dense: the shared decoder with per-head q/k RMSNorm, RoPE theta 1e6 and head_dim 128."""

from tessera.models.common.counts import check_decoder_layout, decoder_counts
from tessera.models.contract import Family
from tessera.models.qwen3.dense import hf
from tessera.models.qwen3.dense.args import FLAVORS, TAKES_TOKENIZER_VOCAB

FAMILY = Family(name="qwen3", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=decoder_counts, check_layout=check_decoder_layout, embedding="tok_embeddings.weight",
                high_precision=("output",), torch_side="tessera.models.qwen3.dense.spec:SPEC",
                hf_model_type="qwen3")
