"""Hugging Face <-> Tessera for Qwen 3.5 MoE (`Qwen3_5MoeForCausalLM`; a `Qwen3_5MoeForConditionalGeneration`
folder's text model): tessera/models/qwen3_5/hf.py."""

from tessera.models.common import hf as shared
from tessera.models.qwen3_5 import hf as group
from tessera.models.qwen3_5.moe.args import Qwen35MoeArgs

to_hf, from_hf, stored_names, fit_to_weights = group.to_hf, group.from_hf, group.stored_names, group.fit_to_weights
carried = group.CARRIED  # the MTP head, written back into exports
to_hf_for = group.to_hf_for  # the experts fused as released, or one tensor each as transformers saves them
MODEL_TYPE = "qwen3_5_moe_text"


def args_from_hf_config(config: dict) -> Qwen35MoeArgs:
    """A `Qwen3_5MoeTextConfig` config.json (or a `Qwen3_5MoeConfig` one, its text_config): experts and a gated
    shared expert in every block."""
    config = group.text_config(config, MODEL_TYPE)
    return Qwen35MoeArgs(**group.common_args(config, "qwen3_5_moe", MODEL_TYPE), ffn_hidden=0,
                         n_experts=shared.positive_int(config, "num_experts"),
                         top_k=shared.positive_int(config, "num_experts_per_tok"),
                         moe_hidden=shared.positive_int(config, "moe_intermediate_size"),
                         shared_hidden=shared.positive_int(config, "shared_expert_intermediate_size"))


def hf_config(args: Qwen35MoeArgs, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' Qwen3_5MoeForCausalLM."""
    out = group.common_config(args, "Qwen3_5MoeForCausalLM", MODEL_TYPE, bos_id, eos_id)
    out.pop("intermediate_size")
    return {**out, "num_experts": args.n_experts, "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.moe_hidden, "shared_expert_intermediate_size": args.shared_hidden}
