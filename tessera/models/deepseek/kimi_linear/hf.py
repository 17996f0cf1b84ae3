"""Hugging Face <-> Tessera for Kimi Linear (`KimiLinearForCausalLM`), in its released layout, which transformers'
save_pretrained writes too: KDA's convolutions one per q, k and v (`self_attn.q_conv1d.weight` [channels, 1, K]),
its decay's A as [1, 1, heads, 1], the MoE blocks under `block_sparse_moe.` with one tensor per expert (`w1` gate,
`w2` down, `w3` up), the dense block's SwiGLU under `mlp.` (save_pretrained writes it under `block_sparse_moe.`:
both load). config.json keeps KDA's shape in `linear_attn_config` (its MLA blocks counted from 1) and DeepSeek's
MoE under Kimi's names (num_experts, moe_renormalize, ...); transformers' own names are read too."""

import re

from tessera.models.common import hf as shared
from tessera.models.deepseek.kimi_linear.args import FULL, LINEAR, KimiLinearArgs, default_layer_types

MODEL_TYPE = "kimi_linear"
_MOE = "block_sparse_moe"
_LAYER = {**shared.DECODER_LAYER, "attention.wq_a": "self_attn.q_a_proj", "attention.q_norm": "self_attn.q_a_layernorm",
          "attention.wq_b": "self_attn.q_b_proj", "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
          "attention.kv_norm": "self_attn.kv_a_layernorm", "attention.wkv_b": "self_attn.kv_b_proj",
          **{f"attention.{o}": f"self_attn.{t}" for o, t in (("wf_a", "f_a_proj"), ("wf_b", "f_b_proj"),
                                                            ("wb", "b_proj"), ("wg_a", "g_a_proj"),
                                                            ("wg_b", "g_b_proj"), ("norm", "o_norm"))},
          "feed_forward.router.gate": f"{_MOE}.gate",
          **{f"feed_forward.shared.{o}": f"{_MOE}.shared_experts.{t}"
             for o, t in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}}
_NAMES = shared.Renamer("Kimi Linear", _LAYER, shared.DECODER_TOP)
_OURS = re.compile(r"layers\.(\d+)\.(attention\.heads\.(A_log|dt_bias|conv_[qkv])|feed_forward\.experts\.(w[123])"
                   r"|feed_forward\.expert_bias)")
_THEIRS = re.compile(rf"model\.layers\.(\d+)\.(self_attn\.(A_log|dt_bias|[qkv]_conv1d\.weight)"
                     rf"|{_MOE}\.experts\.(\d+)\.(w[123])\.weight|{_MOE}\.gate\.e_score_correction_bias)")
_DENSE_SAVED = re.compile(rf"(model\.layers\.\d+\.){_MOE}\.(gate_proj|up_proj|down_proj)\.weight")


def stored_names(names) -> dict:
    """{name in a folder: its to_hf name}: a dense block's SwiGLU as save_pretrained writes it (under
    block_sparse_moe.) is the released mlp.'s."""
    return {name: _DENSE_SAVED.sub(r"\1mlp.\2.weight", name) for name in names}


def to_hf(state: dict) -> dict:
    """The per-head parameters and expert tensors are views of ours (loading fills them in place)."""
    out = {}
    for name, value in state.items():
        m = _OURS.fullmatch(name)
        if m is None:
            out.update(_NAMES.to_hf({name: value}))
            continue
        prefix, part = f"model.layers.{m[1]}.", m[3]
        if part == "A_log":
            out[prefix + "self_attn.A_log"] = None if value is None else value.unsqueeze(0).unsqueeze(0).unsqueeze(-1)
        elif part == "dt_bias":
            out[prefix + "self_attn.dt_bias"] = value
        elif part:  # conv_q -> q_conv1d
            out[f"{prefix}self_attn.{part[-1]}_conv1d.weight"] = None if value is None else value.unsqueeze(1)
        elif m[4]:
            out.update({f"{prefix}{_MOE}.experts.{e}.{m[4]}.weight": expert for e, expert in shared.experts_of(value)})
        else:
            out[f"{prefix}{_MOE}.gate.e_score_correction_bias"] = value
    return out


def from_hf(state: dict) -> dict:
    out, experts = {}, {}
    for name, value in state.items():
        m = _THEIRS.fullmatch(name)
        if m is None:
            out.update(_NAMES.from_hf({name: value}))
            continue
        ours, part = f"layers.{m[1]}.", m[3]
        if part == "A_log":
            out[ours + "attention.heads.A_log"] = None if value is None else value.reshape(-1)
        elif part == "dt_bias":
            out[ours + "attention.heads.dt_bias"] = value
        elif part:
            out[f"{ours}attention.heads.conv_{part[0]}"] = None if value is None else value.squeeze(1)
        elif m[4]:
            experts.setdefault(f"{ours}feed_forward.experts.{m[5]}", {})[int(m[4])] = value
        else:
            out[ours + "feed_forward.expert_bias"] = value
    return {**out, **shared.stack_all(experts)}


def _first(config: dict, keys: tuple[str, ...], default=None):
    return next((config[k] for k in keys if config.get(k) is not None), default)


def _layer_types(config: dict, n_layers: int) -> list[str]:
    """layer_types; else linear_attn_config's full_attn_layers (MLA blocks counted from 1); else transformers'
    default."""
    if config.get("layer_types") is not None:
        return list(config["layer_types"])
    full = (config.get("linear_attn_config") or {}).get("full_attn_layers")
    if full is None:
        return default_layer_types(n_layers)
    if not isinstance(full, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n_layers
                                         for i in full):
        raise ValueError(f"linear_attn_config.full_attn_layers = {full!r}: MLA blocks counted from 1 to {n_layers}")
    return [FULL if i + 1 in full else LINEAR for i in range(n_layers)]


def _first_dense(config: dict) -> int:
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        return int(config.get("first_k_dense_replace", 1))
    dense = kinds.count("dense")
    if kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense):
        raise ValueError(f"mlp_layer_types = {kinds}: Tessera builds the dense blocks first, then the MoE ones")
    return dense


def args_from_hf_config(config: dict) -> KimiLinearArgs:
    """A `KimiLinearConfig` config.json, with Kimi's names (the release's) or transformers' own. Gates other than
    transformers' KDA computes (gate_lower_bound, use_full_rank_gate, an MLA output gate) are refused."""
    shared.refuse_unsupported(config, MODEL_TYPE, MODEL_TYPE, {"hidden_act": "silu", "attention_bias": False},
                              ("default",))
    linear = config.get("linear_attn_config") or {}
    other = [f"{k} = {v!r}" for k, v in {**config, **linear}.items()
             if (k in ("gate_lower_bound", "mla_use_output_gate") and v) or (k == "use_full_rank_gate" and v)
             or (k == "moe_router_activation_func" and v != "sigmoid")]
    if other:
        raise ValueError(f"{', '.join(other)}: Tessera's kimi_linear computes transformers' Kimi Linear (low-rank "
                         f"decay gate without a lower bound, no MLA output gate, sigmoid routing)")
    n_layers, heads = shared.positive_int(config, "num_hidden_layers"), shared.positive_int(config,
                                                                                          "num_attention_heads")
    if config.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads = {config['num_key_value_heads']}: MLA expands keys and values for "
                         f"every one of the {heads} heads")
    kda = {"linear_heads": _first(linear, ("num_heads",), config.get("linear_num_heads", 32)),
           "linear_head_dim": _first(linear, ("head_dim",), config.get("linear_head_dim", 128)),
           "conv_kernel": _first(linear, ("short_conv_kernel_size",), config.get("linear_conv_kernel_dim", 4))}
    kda = {k: shared.positive_int(kda, k) for k in kda}
    moe = {"n_experts": _first(config, ("num_experts", "num_local_experts", "n_routed_experts"), 256),
           "top_k": _first(config, ("num_experts_per_token", "num_experts_per_tok"), 8),
           "n_shared": _first(config, ("num_shared_experts", "n_shared_experts"), 1),
           "n_groups": _first(config, ("num_expert_group", "n_group"), 1),
           "top_groups": _first(config, ("topk_group",), 1)}
    moe = {k: shared.positive_int(moe, k) if k != "n_shared" else int(v) for k, v in moe.items()}
    return KimiLinearArgs(
        dim=shared.positive_int(config, "hidden_size"), n_layers=n_layers, n_heads=heads,
        q_lora_rank=config.get("q_lora_rank") or 0, kv_lora_rank=shared.positive_int(config, "kv_lora_rank"),
        qk_nope_head_dim=shared.positive_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=shared.positive_int(config, "qk_rope_head_dim"),
        v_head_dim=shared.positive_int(config, "v_head_dim"),
        ffn_hidden=shared.positive_int(config, "intermediate_size"),
        moe_hidden=shared.positive_int(config, "moe_intermediate_size"), **moe, score_func="sigmoid",
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(_first(config, ("moe_renormalize", "norm_topk_prob"), True)),
        first_k_dense=_first_dense(config), vocab_size=shared.positive_int(config, "vocab_size"),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_interleave=False,
        max_seq_len=int(_first(config, ("model_max_length", "max_position_embeddings"), 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), **kda,
        layer_types=_layer_types(config, n_layers))


def hf_config(args: KimiLinearArgs, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' KimiLinearForCausalLM, in the release's form."""
    out = shared.decoder_config(args, "KimiLinearForCausalLM", MODEL_TYPE, {"rope_type": "default"},
                                args.max_seq_len, bos_id, eos_id)
    for key in ("rope_theta", "rope_parameters", "max_position_embeddings", "head_dim"):
        out.pop(key)
    full = [i + 1 for i in range(args.n_layers) if not args.linear(i)]
    # pad_token_id: transformers' default (163839, the release's) would index past a smaller vocabulary
    return {**out, "model_max_length": args.max_seq_len, "pad_token_id": None, "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim, "mla_use_nope": True,
            "moe_intermediate_size": args.moe_hidden, "num_experts": args.n_experts,
            "num_experts_per_token": args.top_k, "num_shared_experts": args.n_shared,
            "num_expert_group": args.n_groups, "topk_group": args.top_groups,
            "routed_scaling_factor": args.route_scale, "moe_renormalize": args.norm_topk_prob,
            "moe_router_activation_func": "sigmoid", "first_k_dense_replace": args.first_k_dense,
            "linear_attn_config": {"full_attn_layers": full,
                                   "kda_layers": [i + 1 for i in range(args.n_layers) if args.linear(i)],
                                   "num_heads": args.linear_heads, "head_dim": args.linear_head_dim,
                                   "short_conv_kernel_size": args.conv_kernel}}


peft_param = shared.fused_expert_param
