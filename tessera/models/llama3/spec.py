"""What the trainer needs from the family."""

from tessera.models.llama3.args import FLAVORS, TAKES_TOKENIZER_VOCAB, Llama3Args
from tessera.models.llama3.model import Transformer
from tessera.models.llama3.parallelize import parallelize

# Modules that only the first / the last pipeline stage holds.
FIRST_STAGE_MODULES, LAST_STAGE_MODULES = ("tok_embeddings",), ("norm", "output")

__all__ = ["FIRST_STAGE_MODULES", "LAST_STAGE_MODULES", "FLAVORS", "TAKES_TOKENIZER_VOCAB", "Llama3Args", "Transformer", "parallelize"]
