"""Hugging Face <-> Tessera for GPT-OSS (`GptOssForCausalLM`): attention as the shared decoder's (with biases)
plus `self_attn.sinks`; the router `mlp.router` with its bias; the experts as the hub stores them, fused and
transposed: `gate_up_proj` [E, dim, 2 hidden] with gate and up interleaved (even and odd columns) and
`down_proj` [E, hidden, dim], each with a bias."""

import re

from tessera.models.common import hf as shared
from tessera.models.gpt_oss.args import FULL, SLIDING, GptOssArgs

_NAMES = shared.Renamer("GPT-OSS", {**{k: v for k, v in shared.DECODER_LAYER.items()
                                       if not k.startswith("feed_forward.")},
                                    "feed_forward.router.gate": "mlp.router"}, shared.DECODER_TOP)
_SINKS = (re.compile(r"layers\.(\d+)\.attention\.sdpa\.sinks"), re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks"))
_OURS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])(_bias)?")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def _interleave(gate, up):  # [E, hidden, ...] twice -> [E, ..., 2 hidden], gate in the even columns
    import torch

    return torch.stack([gate.transpose(1, -1), up.transpose(1, -1)], dim=-1).flatten(-2)


def _split(gate_up, which: int):  # the inverse, for gate (0) or up (1)
    return gate_up[..., which::2].transpose(1, -1)


def to_hf(state: dict) -> dict:
    """gate_up is a fresh tensor (loading fills it; from_hf folds it back), down a transposed view of w2."""
    out, experts = {}, {}
    for name, value in state.items():
        if m := _SINKS[0].fullmatch(name):
            out[f"model.layers.{m[1]}.self_attn.sinks"] = value
        elif name.endswith("feed_forward.expert_bias"):
            continue  # aux-loss-free balancing's selection bias: no place in HF's format
        elif m := _OURS.fullmatch(name):
            experts[(m[1], m[2], m[3] or "")] = value
        else:
            out.update(_NAMES.to_hf({name: value}))
    for layer, suffix in {(k[0], k[2]) for k in experts}:
        prefix = f"model.layers.{layer}.mlp.experts."
        w = {k[1]: v for k, v in experts.items() if k[::2] == (layer, suffix)}
        out[f"{prefix}gate_up_proj{suffix}"] = shared.on_experts(_interleave, w["w1"], w["w3"])
        out[f"{prefix}down_proj{suffix}"] = shared.on_experts(lambda t: t.transpose(1, -1), w["w2"])
    return out


def from_hf(state: dict) -> dict:
    out = {}
    for name, value in state.items():
        if m := _SINKS[1].fullmatch(name):
            out[f"layers.{m[1]}.attention.sdpa.sinks"] = value
        elif m := _THEIRS.fullmatch(name):
            ours, bias = f"layers.{m[1]}.feed_forward.experts.", m[3] or ""
            if m[2] == "down_proj":
                out[f"{ours}w2{bias}"] = shared.on_experts(lambda t: t.transpose(1, -1), value)
            else:
                out[f"{ours}w1{bias}"] = shared.on_experts(lambda t: _split(t, 0), value)
                out[f"{ours}w3{bias}"] = shared.on_experts(lambda t: _split(t, 1), value)
        else:
            out.update(_NAMES.from_hf({name: value}))
    return out


def args_from_hf_config(config: dict) -> GptOssArgs:
    """A `GptOssForCausalLM` config.json (YaRN or plain RoPE; any pattern of sliding and full layers)."""
    shared.refuse_unsupported(config, "gpt_oss", "gpt_oss", {"hidden_act": "silu", "attention_bias": True},
                              ("default", "yarn"))
    dim, n_heads, kv_heads, head_dim = shared.heads({"head_dim": 64, **config})
    n_layers = shared.positive_int(config, "num_hidden_layers")
    types = config.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types = {types!r}: one of {SLIDING!r} or {FULL!r} for each of the {n_layers} layers")
    rope = shared.rope_parameters({"rope_theta": 150000.0, **config})
    yarn = {"rope_type": "yarn", **{k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}} \
        if rope["rope_type"] == "yarn" else None
    return GptOssArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=kv_heads, head_dim=head_dim,
        n_experts=shared.positive_int(config, "num_local_experts"),
        top_k=shared.positive_int(config, "num_experts_per_tok"),
        moe_hidden=shared.positive_int(config, "intermediate_size"),
        window=int(config.get("sliding_window") or 0),
        layer_types=None if types == [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)] else list(types),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)), swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        vocab_size=shared.positive_int(config, "vocab_size"), norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope["rope_theta"]), rope_scaling=yarn,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def hf_config(args: GptOssArgs, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' GptOssForCausalLM."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(args.rope_scaling or {})}
    types = args.layer_types or [SLIDING if args.sliding(i) else FULL for i in range(args.n_layers)]
    return {**shared.decoder_config(args, "GptOssForCausalLM", "gpt_oss", rope, args.max_seq_len, bos_id, eos_id),
            "intermediate_size": args.moe_hidden, "num_local_experts": args.n_experts,
            "num_experts_per_tok": args.top_k, "sliding_window": args.window, "layer_types": types,
            "swiglu_limit": args.swiglu_limit, "swiglu_alpha": args.swiglu_alpha}
