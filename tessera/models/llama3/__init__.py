"""Llama 3 / 3.1 / 3.2: the shared decoder with Llama 3.1's RoPE scaling."""

from tessera.models.common.counts import check_decoder_layout, decoder_counts
from tessera.models.contract import Family
from tessera.models.llama3 import hf
from tessera.models.llama3.args import FLAVORS, TAKES_TOKENIZER_VOCAB

FAMILY = Family(name="llama3", flavors=FLAVORS, takes_tokenizer_vocab=frozenset(TAKES_TOKENIZER_VOCAB), hf=hf,
                counts=decoder_counts, check_layout=check_decoder_layout, embedding="tok_embeddings.weight",
                high_precision=("output",), torch_side="tessera.models.llama3.spec:SPEC",
                hf_model_type="llama")
