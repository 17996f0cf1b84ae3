"""Hugging Face <-> Tessera for Llama (`LlamaForCausalLM`). Our q/k layout is HF's already, so only names change."""

from tessera.models.common import hf as shared
from tessera.models.llama3.args import Llama3Args

_NAMES = shared.Renamer("Llama 3", shared.DECODER_LAYER, shared.DECODER_TOP)
to_hf, from_hf = _NAMES.to_hf, _NAMES.from_hf


def args_from_hf_config(config: dict) -> Llama3Args:
    """The architecture a transformers `LlamaForCausalLM` config.json describes. A setting Tessera's Llama does not
    compute (MLP biases, another activation or RoPE type) is refused: the weights would load into other math."""
    shared.refuse_unsupported(config, "llama3", "llama", {"hidden_act": "silu", "mlp_bias": False},
                              ("default", "llama3"))
    rope = shared.rope_parameters(config)
    dim, n_heads, kv_heads, head_dim = shared.heads(config)
    scaled = rope["rope_type"] == "llama3"
    try:
        return Llama3Args(
            dim=dim, n_layers=shared.positive_int(config, "num_hidden_layers"), n_heads=n_heads, n_kv_heads=kv_heads,
            vocab_size=shared.positive_int(config, "vocab_size"), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]), rope_scaling_factor=float(rope["factor"]) if scaled else 0.0,
            rope_low_freq_factor=float(rope["low_freq_factor"]) if scaled else 1.0,
            rope_high_freq_factor=float(rope["high_freq_factor"]) if scaled else 4.0,
            rope_original_max_pos=int(rope["original_max_position_embeddings"]) if scaled else 8192,
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim_override=head_dim if head_dim != dim // n_heads else 0,
            ffn_hidden_override=shared.positive_int(config, "intermediate_size"),
            attention_bias=bool(config.get("attention_bias", False)))
    except KeyError as e:
        raise ValueError(f"rope_parameters lacks {e} for rope_type 'llama3'") from None


def hf_config(args: Llama3Args, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(args.rope_scaling or {})}
    max_pos = args.max_seq_len
    if args.rope_scaling_factor:  # transformers wants the scaled context above the original one
        max_pos = max(max_pos, int(args.rope_original_max_pos * args.rope_scaling_factor))
    return {**shared.decoder_config(args, "LlamaForCausalLM", "llama", rope, max_pos, bos_id, eos_id),
            "rope_scaling": rope if args.rope_scaling_factor else None, "mlp_bias": False}
