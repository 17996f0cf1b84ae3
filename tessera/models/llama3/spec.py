"""What the trainer needs from the family."""

from tessera.models.llama3.args import FLAVORS, TAKES_TOKENIZER_VOCAB, Llama3Args
from tessera.models.llama3.model import Transformer
from tessera.models.llama3.parallelize import parallelize

__all__ = ["FLAVORS", "TAKES_TOKENIZER_VOCAB", "Llama3Args", "Transformer", "parallelize"]
