"""Hugging Face <-> Tessera for Qwen 3 dense (`Qwen3ForCausalLM`): Llama's names plus the q/k norms."""

from tessera.models.common import hf as shared
from tessera.models.qwen3.dense.args import Qwen3Args

_NAMES = shared.Renamer("Qwen 3", {**shared.DECODER_LAYER, "attention.q_norm": "self_attn.q_norm",
                                   "attention.k_norm": "self_attn.k_norm"}, shared.DECODER_TOP)
to_hf, from_hf = _NAMES.to_hf, _NAMES.from_hf


def args_from_hf_config(config: dict) -> Qwen3Args:
    """The architecture a transformers `Qwen3ForCausalLM` config.json describes; sliding-window attention,
    biases, another activation or a RoPE other than plain and YaRN are refused."""
    shared.refuse_unsupported(config, "qwen3", "qwen3", {"hidden_act": "silu", "attention_bias": False,
                                                  "use_sliding_window": False}, ("default", "yarn"))
    dim, n_heads, kv_heads, head_dim = shared.heads({"head_dim": 128, **config})
    rope = shared.rope_parameters({"rope_theta": 10000.0, **config})
    return Qwen3Args(dim=dim, n_layers=shared.positive_int(config, "num_hidden_layers"), n_heads=n_heads,
                     n_kv_heads=kv_heads, head_dim=head_dim,
                     ffn_hidden=shared.positive_int(config, "intermediate_size"),
                     vocab_size=shared.positive_int(config, "vocab_size"),
                     norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                     rope_theta=float(rope["rope_theta"]), rope_scaling=_yarn(rope),
                     max_seq_len=int(config.get("max_position_embeddings", 32768)),
                     tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def _yarn(rope: dict) -> dict | None:
    if rope["rope_type"] != "yarn":
        return None
    if not rope.get("factor") or not rope.get("original_max_position_embeddings"):
        raise ValueError("rope_parameters: YaRN needs factor and original_max_position_embeddings")
    return {"rope_type": "yarn", **{k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None}}


_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "mscale",
              "mscale_all_dim", "attention_factor")


def hf_config(args: Qwen3Args, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' Qwen3ForCausalLM."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(args.rope_scaling or {})}
    max_pos = args.max_seq_len
    if args.rope_scaling:  # transformers reads YaRN's factor as this over the original context as well
        max_pos = int(args.rope_scaling["original_max_position_embeddings"] * args.rope_scaling["factor"])
    return {**shared.decoder_config(args, "Qwen3ForCausalLM", "qwen3", rope, max_pos, bos_id, eos_id),
            "use_sliding_window": False}
