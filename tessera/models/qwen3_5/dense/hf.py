"""Hugging Face <-> Tessera for Qwen 3.5 dense (`Qwen3_5ForCausalLM`; a `Qwen3_5ForConditionalGeneration`
folder's text model): tessera/models/qwen3_5/hf.py."""

from tessera.models.common import hf as shared
from tessera.models.qwen3_5 import hf as group
from tessera.models.qwen3_5.args import Qwen35Args

to_hf, from_hf, stored_names, fit_to_weights = group.to_hf, group.from_hf, group.stored_names, group.fit_to_weights
carried = group.CARRIED  # the MTP head, written back into exports
MODEL_TYPE = "qwen3_5_text"


def args_from_hf_config(config: dict) -> Qwen35Args:
    """A `Qwen3_5TextConfig` config.json (or a `Qwen3_5Config` one, its text_config); any pattern of DeltaNet and
    full-attention layers."""
    config = group.text_config(config, MODEL_TYPE)
    return Qwen35Args(**group.common_args(config, "qwen3_5", MODEL_TYPE),
                      ffn_hidden=shared.positive_int(config, "intermediate_size"))


def hf_config(args: Qwen35Args, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' Qwen3_5ForCausalLM."""
    return group.common_config(args, "Qwen3_5ForCausalLM", MODEL_TYPE, bos_id, eos_id)
