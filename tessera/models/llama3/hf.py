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


def from_hf(state: dict, args: Llama3Args) -> dict:
    out = {_rename(k, _FROM_HF): v for k, v in state.items()}
    if args.tie_embeddings:
        out.pop("output.weight", None)
    return out


def hf_config(args: Llama3Args) -> dict:
    """config.json for transformers' LlamaForCausalLM."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor:
        rope.update(rope_type="llama3", factor=args.rope_scaling_factor, low_freq_factor=args.rope_low_freq_factor,
                    high_freq_factor=args.rope_high_freq_factor,
                    original_max_position_embeddings=args.rope_original_max_pos)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "rope_scaling": rope if args.rope_scaling_factor else None, "rope_parameters": rope,
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
