"""Hugging Face <-> Tessera for Llama 4's text model (`Llama4ForCausalLM`). Attention and norms are named as in
Llama; a layer's FFN is `feed_forward`: a dense layer's `gate_proj`/`up_proj`/`down_proj`, a MoE layer's
`router`, `shared_expert` and the experts fused as the hub stores them: `gate_up_proj` [E, dim, 2 hidden] (gate
in the first half of the columns, up in the second) and `down_proj` [E, hidden, dim].

The released checkpoints are `Llama4ForConditionalGeneration`: the text model under `language_model.` beside the
vision tower, and config.json's `text_config`. Such a folder imports its text part; export writes
`Llama4ForCausalLM`."""

import re

from tessera.models.common import hf as shared
from tessera.models.common.moe_args import sparse_layers
from tessera.models.llama4.args import Llama4Args

_FFN = {"feed_forward.w1": "feed_forward.gate_proj", "feed_forward.w2": "feed_forward.down_proj",
        "feed_forward.w3": "feed_forward.up_proj", "feed_forward.router.gate": "feed_forward.router"}
_SHARED = {f"feed_forward.shared.{ours}": f"feed_forward.shared_expert.{theirs}"
           for ours, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}
_NAMES = shared.Renamer("Llama 4", {**{k: v for k, v in shared.DECODER_LAYER.items()
                                      if not k.startswith("feed_forward.")}, **_FFN, **_SHARED}, shared.DECODER_TOP)
_OURS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)")
_TEXT = "language_model."  # the text model's prefix in a multimodal checkpoint
CHUNKED, FULL = "chunked_attention", "full_attention"


def _fuse(gate, up):  # [E, hidden, dim] twice -> [E, dim, 2 hidden]
    import torch

    return torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], dim=-1)


def _transposed(t):  # w2 [E, dim, hidden] <-> down_proj [E, hidden, dim]
    return t.transpose(1, 2)


def _half(which: int):  # gate (0) or up (1) of gate_up_proj, as w1 / w3 [E, hidden, dim]
    return lambda gate_up: gate_up.unflatten(-1, (2, -1)).select(-2, which).transpose(1, 2)


_SPLIT = {"gate_up_proj": (("w1", _half(0)), ("w3", _half(1))), "down_proj": (("w2", _transposed),)}


def to_hf(state: dict) -> dict:
    """gate_up is a fresh tensor (loading fills it; from_hf folds it back), down a transposed view of w2. The
    selection bias of aux-loss-free balancing has no place in HF's format: it is left out."""
    out, experts = {}, {}
    for name, value in state.items():
        if name.endswith("feed_forward.expert_bias"):
            continue
        if m := _OURS.fullmatch(name):
            experts.setdefault(m[1], {})[m[2]] = value
        else:
            out.update(_NAMES.to_hf({name: value}))
    for layer, w in experts.items():
        prefix = f"model.layers.{layer}.feed_forward.experts."
        out[f"{prefix}gate_up_proj"] = shared.on_experts(_fuse, w["w1"], w["w3"])
        out[f"{prefix}down_proj"] = shared.on_experts(_transposed, w["w2"])
    return out


def from_hf(state: dict) -> dict:
    out = {}
    for name, value in state.items():
        if m := _THEIRS.fullmatch(name):
            out.update({f"layers.{m[1]}.feed_forward.experts.{ours}": shared.on_experts(split, value)
                        for ours, split in _SPLIT[m[2]]})
        else:
            out.update(_NAMES.from_hf({name: value}))
    return out


def stored_names(names) -> dict:
    """{name in the checkpoint: its name as to_hf gives it, or None for a tensor of no text model}: a multimodal
    checkpoint's text model is under `language_model.`, and its vision tower and projector are not ours."""
    names = list(names)
    if not any(n.startswith(_TEXT) for n in names):
        return {n: n for n in names}
    return {n: n.removeprefix(_TEXT) if n.startswith(_TEXT) else None for n in names}


def _text_config(config: dict) -> dict:
    if config.get("model_type") != "llama4" and "text_config" not in config:
        return config
    if not isinstance(config.get("text_config"), dict):
        raise ValueError("text_config is missing: a multimodal Llama 4 config.json holds its text model's there")
    return config["text_config"]


def _pattern(config: dict, key: str, n_layers: int, derived: list[int]) -> list[int]:
    given = config.get(key)
    if not given:
        return derived
    if not isinstance(given, list) or len(given) < n_layers:
        raise ValueError(f"{key} = {given!r}: one entry per layer (num_hidden_layers = {n_layers})")
    return [int(bool(v)) for v in given[:n_layers]]


def args_from_hf_config(config: dict) -> Llama4Args:
    """A `Llama4ForCausalLM` config.json, or a `Llama4ForConditionalGeneration` one (its text_config). Llama 3
    or plain RoPE; any pattern of NoPE and MoE layers; chunked attention on exactly the RoPE layers."""
    config = _text_config(config)
    shared.refuse_unsupported(config, "llama4", "llama4_text", {"hidden_act": "silu", "attention_bias": False},
                              ("default", "llama3"))
    dim, n_heads, kv_heads, head_dim = shared.heads({"head_dim": 128, **config})
    n_layers = shared.positive_int(config, "num_hidden_layers")
    interval = shared.positive_int({"no_rope_layer_interval": 4, **config}, "no_rope_layer_interval")
    every_interval = [int((i + 1) % interval != 0) for i in range(n_layers)]  # HF's defaults
    rope_layers = _pattern(config, "no_rope_layers", n_layers, every_interval)
    step = shared.positive_int({"interleave_moe_layer_step": 1, **config}, "interleave_moe_layer_step")
    every_step = list(sparse_layers(n_layers, step))
    moe_layers = every_step if config.get("moe_layers") is None else config["moe_layers"]
    if not all(isinstance(i, int) and 0 <= i < n_layers for i in moe_layers):
        raise ValueError(f"moe_layers = {moe_layers!r}: layer indices below num_hidden_layers ({n_layers})")
    chunk = config.get("attention_chunk_size", 8192)
    chunk = 0 if chunk is None else shared.positive_int(config, "attention_chunk_size")
    types = [CHUNKED if rope and chunk else FULL for rope in rope_layers]
    if config.get("layer_types") is not None and list(config["layer_types"]) != types:
        raise ValueError(f"layer_types = {config['layer_types']!r}: Tessera's llama4 chunks exactly the RoPE layers "
                         f"(no_rope_layers) when attention_chunk_size is set, i.e. {types!r}")
    rope = shared.rope_parameters({"rope_theta": 500000.0, **config})
    try:
        scaling = {"rope_type": "llama3", **{k: float(rope[k]) for k in ("factor", "low_freq_factor",
                                                                         "high_freq_factor")},
                   "original_max_position_embeddings": int(rope["original_max_position_embeddings"])} \
            if rope["rope_type"] == "llama3" else None
    except KeyError as e:
        raise ValueError(f"rope_parameters lacks {e} for rope_type 'llama3'") from None
    return Llama4Args(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=kv_heads, head_dim=head_dim,
        ffn_hidden=shared.positive_int({"intermediate_size_mlp": 16384, **config}, "intermediate_size_mlp"),
        moe_hidden=shared.positive_int({"intermediate_size": 8192, **config}, "intermediate_size"),
        n_experts=shared.positive_int({"num_local_experts": 16, **config}, "num_local_experts"),
        top_k=shared.positive_int({"num_experts_per_tok": 1, **config}, "num_experts_per_tok"),
        moe_step=step, moe_layers=None if moe_layers == every_step else sorted(moe_layers), nope_interval=interval,
        rope_layers=None if rope_layers == every_interval else rope_layers,
        chunk=chunk, qk_norm_l2=bool(config.get("use_qk_norm", True)),
        temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
        floor_scale=shared.positive_int({"floor_scale": 8192, **config}, "floor_scale"),
        attn_scale=float(config.get("attn_scale", 0.1)), vocab_size=shared.positive_int(config, "vocab_size"),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=float(rope["rope_theta"]), rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 8192)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def hf_config(args: Llama4Args, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' Llama4ForCausalLM, its layer patterns written out."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(args.rope_scaling or {})}
    max_pos = args.max_seq_len
    if args.rope_scaling:  # transformers wants the scaled context above the original one
        max_pos = max(max_pos, int(args.rope_scaling["original_max_position_embeddings"] * args.rope_scaling["factor"]))
    layers = range(args.n_layers)
    return {**shared.decoder_config(args, "Llama4ForCausalLM", "llama4_text", rope, max_pos, bos_id, eos_id),
            "intermediate_size": args.moe_hidden, "intermediate_size_mlp": args.ffn_hidden,
            "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
            "interleave_moe_layer_step": args.moe_step, "moe_layers": [i for i in layers if args.is_moe(i)],
            "no_rope_layer_interval": args.nope_interval, "no_rope_layers": [int(args.uses_rope(i)) for i in layers],
            "attention_chunk_size": args.chunk or None,
            "layer_types": [CHUNKED if args.chunked(i) else FULL for i in layers], "use_qk_norm": args.qk_norm_l2,
            "attn_temperature_tuning": args.temperature_tuning, "floor_scale": args.floor_scale,
            "attn_scale": args.attn_scale}
