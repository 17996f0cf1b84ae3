"""Hugging Face <-> Tessera names for Llama. Our q/k layout is HF's already, so only names change."""

import re

from tessera.models.llama3.args import Llama3Args

_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_TO_HF = {**{rf"layers\.(\d+)\.{re.escape(k)}\.weight": rf"model.layers.\1.{v}.weight" for k, v in _LAYER.items()},
          **{re.escape(k): v for k, v in _TOP.items()}}
_FROM_HF = {**{rf"model\.layers\.(\d+)\.{re.escape(v)}\.weight": rf"layers.\1.{k}.weight" for k, v in _LAYER.items()},
            **{re.escape(v): k for k, v in _TOP.items()}}


def _rename(name: str, table: dict) -> str:
    for pattern, repl in table.items():
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    raise KeyError(f"no Llama 3 mapping for parameter '{name}'")


def to_hf(state: dict) -> dict:
    return {_rename(k, _TO_HF): v for k, v in state.items()}


def from_hf(state: dict) -> dict:
    """Checkpoint names -> ours. A tied model has no output.weight: an `lm_head.weight` beside tied embeddings
    maps to a tensor the model lacks, which the loader refuses rather than drop."""
    return {_rename(k, _FROM_HF): v for k, v in state.items()}


def _positive_int(config: dict, key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} = {value!r}; a positive integer is required")
    return value


def _rope(config: dict) -> dict:
    """transformers 5 keeps rope_theta in rope_parameters; 4.x beside rope_scaling (null when unscaled)."""
    rope = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0),
            **(config.get("rope_parameters") or config.get("rope_scaling") or {})}
    rope["rope_type"] = rope.get("type", rope["rope_type"])
    return rope


def args_from_hf_config(config: dict) -> Llama3Args:
    """The architecture a transformers `LlamaForCausalLM` config.json describes. A setting Tessera's Llama does not
    compute (biases, another activation or RoPE type) is refused: the weights would load into other math."""
    if config.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type = {config['model_type']!r}, not 'llama'; set model.name to its family")
    rope = _rope(config)
    other = [f"{k} = {config[k]!r}" for k, want in (("hidden_act", "silu"), ("attention_bias", False),
                                                     ("mlp_bias", False)) if config.get(k, want) != want]
    if rope["rope_type"] not in ("default", "llama3"):
        other.append(f"rope_type = {rope['rope_type']!r}")
    if other:
        raise ValueError(f"{', '.join(other)}: Tessera's llama3 computes silu MLPs without biases and default or "
                         f"llama3 RoPE only")
    dim, heads = _positive_int(config, "hidden_size"), _positive_int(config, "num_attention_heads")
    kv_heads = _positive_int(config, "num_key_value_heads") if config.get("num_key_value_heads") else heads
    head_dim = _positive_int(config, "head_dim") if config.get("head_dim") else dim // heads
    if heads % kv_heads or head_dim % 2:
        raise ValueError(f"num_attention_heads = {heads}, num_key_value_heads = {kv_heads}, head_dim = {head_dim}: "
                         f"the heads must be a multiple of the key/value heads, and head_dim even")
    scaled = rope["rope_type"] == "llama3"
    try:
        return Llama3Args(
            dim=dim, n_layers=_positive_int(config, "num_hidden_layers"), n_heads=heads, n_kv_heads=kv_heads,
            vocab_size=_positive_int(config, "vocab_size"), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]), rope_scaling_factor=float(rope["factor"]) if scaled else 0.0,
            rope_low_freq_factor=float(rope["low_freq_factor"]) if scaled else 1.0,
            rope_high_freq_factor=float(rope["high_freq_factor"]) if scaled else 4.0,
            rope_original_max_pos=int(rope["original_max_position_embeddings"]) if scaled else 8192,
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim_override=head_dim if head_dim != dim // heads else 0,
            ffn_hidden_override=_positive_int(config, "intermediate_size"))
    except KeyError as e:
        raise ValueError(f"rope_parameters lacks {e} for rope_type 'llama3'") from None


def hf_config(args: Llama3Args, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    max_pos = args.max_seq_len
    if args.rope_scaling_factor:  # transformers wants the scaled context above the original one
        rope.update(rope_type="llama3", factor=args.rope_scaling_factor, low_freq_factor=args.rope_low_freq_factor,
                    high_freq_factor=args.rope_high_freq_factor,
                    original_max_position_embeddings=args.rope_original_max_pos)
        max_pos = max(max_pos, int(args.rope_original_max_pos * args.rope_scaling_factor))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "rope_scaling": rope if args.rope_scaling_factor else None, "rope_parameters": rope,
            "max_position_embeddings": max_pos, "tie_word_embeddings": args.tie_embeddings,
            "bos_token_id": bos_id, "eos_token_id": eos_id,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
