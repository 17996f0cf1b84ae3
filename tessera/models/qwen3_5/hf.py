"""Hugging Face <-> Tessera for Qwen 3.5, dense and MoE (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the
text model of their `...ForConditionalGeneration` releases, under `model.language_model.` beside the vision tower,
which is not ours). transformers fuses DeltaNet's q/k/v projections (`in_proj_qkv`) and their convolutions
(`conv1d` [channels, 1, K]); Tessera keeps them apart so that tensor parallelism splits each by head: loading reads
them into fresh fused tensors that `from_hf` splits back.

The routed experts come in two layouts: the released checkpoints' (and transformers 5's in memory), each layer's as
fused stacks, `mlp.experts.gate_up_proj` [E, 2 hidden, dim] (gate rows first) and `mlp.experts.down_proj` [E, dim,
hidden]; and one tensor per expert (`mlp.experts.N.gate_proj.weight`, ...), which transformers' save_pretrained
writes. Both load (`to_hf_for` picks a folder's); exports write the released one."""

import re

from tessera.models.common import hf as shared
from tessera.models.contract import Carried
from tessera.models.qwen3_5.args import FULL, LINEAR, every_fourth_full

_LAYER = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj",
          "feed_forward.router.gate": "mlp.gate", "feed_forward.shared.gate": "mlp.shared_expert_gate",
          **{f"feed_forward.shared.{o}": f"mlp.shared_expert.{t}"
             for o, t in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}}
_FULL = {f"attention.{o}": f"self_attn.{t}" for o, t in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"),
                                                         ("wo", "o_proj"), ("q_norm", "q_norm"),
                                                         ("k_norm", "k_norm"))}
_LINEAR = {f"attention.{o}": f"linear_attn.{t}" for o, t in (("wz", "in_proj_z"), ("wb", "in_proj_b"),
                                                             ("wa", "in_proj_a"), ("wo", "out_proj"),
                                                             ("norm", "norm"))}
_NAMES = {kind: shared.Renamer("Qwen 3.5", {**_LAYER, **table}, shared.DECODER_TOP)
          for kind, table in ((FULL, _FULL), (LINEAR, _LINEAR))}
_OURS = re.compile(r"layers\.(\d+)\.(attention\.heads\.(A_log|dt_bias|conv_[qkv])|attention\.w[qkv]\.weight"
                   r"|feed_forward\.experts\.w[123]|feed_forward\.expert_bias)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(linear_attn\.(A_log|dt_bias|conv1d\.weight|in_proj_qkv\.weight)"
                     r"|mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight"
                     r"|mlp\.experts\.(gate_up_proj|down_proj))")
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_TEXT = "model.language_model."  # the text model's prefix in a multimodal checkpoint


def _layer(name: str) -> str | None:
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    return m[1] if m else None


def _cat(parts: list, dim: int = 0):
    import torch

    return None if parts[0] is None else torch.cat(parts, dim=dim)


def to_hf_for(names) -> object:
    """The to_hf of a folder holding `names` (after stored_names): one tensor per expert, or the released layout."""
    return to_hf_per_expert if any(_PER_EXPERT.search(n) for n in names) else to_hf


def to_hf(state: dict) -> dict:
    """The released layout: the experts' fused stacks."""
    return _to_hf(state, per_expert=False)


def to_hf_per_expert(state: dict) -> dict:
    """One tensor per expert, as transformers' save_pretrained writes them."""
    return _to_hf(state, per_expert=True)


_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def _to_hf(state: dict, per_expert: bool) -> dict:
    """Fused q/k/v and conv taps are fresh tensors (loading fills them, from_hf splits them back), and so is a fused
    gate_up stack; the other experts are views of the stacks (filled in place). The selection bias of aux-loss-free
    balancing is left out."""
    linear = {_layer(n) for n in state if ".attention.wz." in n}
    out, fused = {}, {}
    for name, value in state.items():
        m = _OURS.fullmatch(name)
        if m is None or (m[2].startswith("attention.w") and m[1] not in linear):  # full attention's own q/k/v
            out.update(_NAMES[LINEAR if _layer(name) in linear else FULL].to_hf({name: value}))
        elif not name.endswith("expert_bias"):
            fused.setdefault(m[1], {})[name.split(".", 2)[2]] = value
    for layer, w in fused.items():
        prefix = f"model.layers.{layer}."
        if "attention.heads.A_log" in w:
            out[prefix + "linear_attn.A_log"] = w["attention.heads.A_log"]
            out[prefix + "linear_attn.dt_bias"] = w["attention.heads.dt_bias"]
            conv = _cat([w[f"attention.heads.conv_{x}"] for x in "qkv"])
            out[prefix + "linear_attn.conv1d.weight"] = None if conv is None else conv.unsqueeze(1)
            out[prefix + "linear_attn.in_proj_qkv.weight"] = _cat([w[f"attention.w{x}.weight"] for x in "qkv"])
        if "feed_forward.experts.w1" not in w:
            continue
        if not per_expert:
            out[prefix + "mlp.experts.gate_up_proj"] = shared.on_experts(
                lambda gate, up: _cat([gate, up], dim=1), w["feed_forward.experts.w1"], w["feed_forward.experts.w3"])
            out[prefix + "mlp.experts.down_proj"] = w["feed_forward.experts.w2"]  # the stack itself
            continue
        for x, proj in _PROJ.items():  # views of the stack, one per expert
            for e, expert in shared.experts_of(w[f"feed_forward.experts.{x}"]):
                out[f"{prefix}mlp.experts.{e}.{proj}.weight"] = expert
    return out


def _split(value, sizes: list[int], dim: int = 0) -> list:
    return [None] * len(sizes) if value is None else list(value.split(sizes, dim=dim))


def from_hf(state: dict) -> dict:
    out, experts = {}, {}
    for name, value in state.items():
        m = _THEIRS.fullmatch(name)
        if m is None:
            out.update(_NAMES[LINEAR if ".linear_attn." in name else FULL].from_hf({name: value}))
            continue
        ours, part = f"layers.{m[1]}.", m[3]
        if part in ("A_log", "dt_bias"):
            out[f"{ours}attention.heads.{part}"] = value
        elif part in ("conv1d.weight", "in_proj_qkv.weight"):
            value_dim = state.get(f"model.layers.{m[1]}.linear_attn.in_proj_z.weight")
            sizes = None if value is None else _qkv_sizes(value.shape[0], value_dim)
            pieces = _split(value if value is None or part == "in_proj_qkv.weight" else value.squeeze(1),
                            sizes or [0, 0, 0])
            for x, piece in zip("qkv", pieces, strict=True):
                out[f"{ours}attention.w{x}.weight" if part == "in_proj_qkv.weight"
                    else f"{ours}attention.heads.conv_{x}"] = piece
        elif m[6] == "down_proj":
            out[f"{ours}feed_forward.experts.w2"] = value
        elif m[6] == "gate_up_proj":
            for x, half in (("w1", 0), ("w3", 1)):
                out[f"{ours}feed_forward.experts.{x}"] = shared.on_experts(
                    lambda gate_up, half=half: gate_up.chunk(2, dim=1)[half], value)
        else:
            back = {v: k for k, v in _PROJ.items()}
            experts.setdefault(f"{ours}feed_forward.experts.{back[m[5]]}", {})[int(m[4])] = value
    return {**out, **shared.stack_all(experts)}


def _qkv_sizes(rows: int, value_proj) -> list[int]:
    if value_proj is None:
        raise KeyError("in_proj_z beside in_proj_qkv (their sizes split q, k and v)")
    value_dim = value_proj.shape[0]
    return [(rows - value_dim) // 2, (rows - value_dim) // 2, value_dim]


def stored_names(names) -> dict:
    """{name in the checkpoint: its to_hf name, or None}: a multimodal release's text model is under
    `model.language_model.`; its vision tower (`model.visual.`) and MTP head (`mtp.`) are not ours."""
    names = list(names)
    multimodal = any(n.startswith(_TEXT) for n in names)
    out = {}
    for n in names:
        if multimodal and n.startswith(_TEXT):
            out[n] = "model." + n.removeprefix(_TEXT)
        elif n.startswith(("model.visual.", "mtp.")):
            out[n] = None
        else:
            out[n] = n
    return out


def fit_to_weights(args, names, train: bool):
    """A multimodal folder's vision tower and MTP head are not Tessera's: left out, said in one line (an HF export
    of the run writes the MTP head back: `carried`)."""
    other = sorted(n for n in names if n.startswith(("model.visual.", "mtp.")))
    note = f"{len(other)} tensors of the vision tower or MTP head ({other[0]}, ...) are not the text model's: " \
           f"not loaded (the MTP head goes into Hugging Face exports unchanged)" if other else None
    return args, (), note


CARRIED = Carried("mtp.", "MTP head", ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"))


def text_config(config: dict, model_type: str) -> dict:
    """A `...ForConditionalGeneration` config.json keeps the text model's in text_config."""
    if "text_config" not in config:
        return config
    if not isinstance(config["text_config"], dict):
        raise ValueError("text_config is not a table: a multimodal Qwen 3.5 config.json holds its text model's there")
    return {"model_type": model_type, **config["text_config"]}


def layer_types(config: dict, n_layers: int) -> list[str]:
    given = config.get("layer_types")
    if given is None:
        interval = shared.positive_int({"full_attention_interval": 4, **config}, "full_attention_interval")
        return every_fourth_full(n_layers, interval)
    if not isinstance(given, list) or len(given) != n_layers or set(given) - {LINEAR, FULL}:
        raise ValueError(f"layer_types = {given!r}: one of {LINEAR!r} or {FULL!r} per layer ({n_layers})")
    return list(given)


def common_args(config: dict, family: str, model_type: str) -> dict:
    """The fields of Qwen35Args a `Qwen3_5(Moe)TextConfig` gives; what Tessera would not compute the same way
    (biases, another activation, a scaled RoPE) is refused."""
    # Released configs of the Qwen 3-Next lineage also say attn_output_gate and mlp_only_layers: the hybrid here
    # always gates attention's output, and puts the family's FFN in every block.
    shared.refuse_unsupported(config, family, model_type, {"hidden_act": "silu", "attention_bias": False,
                                                           "attn_output_gate": True, "mlp_only_layers": []},
                              ("default",))
    dim, n_heads, kv_heads, head_dim = shared.heads({"head_dim": 256, **config})
    n_layers = shared.positive_int(config, "num_hidden_layers")
    rope = shared.rope_parameters({"rope_theta": 10000.0, **config})
    factor = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    if not 0 < factor <= 1 or int(head_dim * factor) % 2:
        raise ValueError(f"partial_rotary_factor = {factor}: head_dim ({head_dim}) times it must be even and > 0")
    k_heads = shared.positive_int({"linear_num_key_heads": 16, **config}, "linear_num_key_heads")
    v_heads = shared.positive_int({"linear_num_value_heads": 32, **config}, "linear_num_value_heads")
    if v_heads % k_heads:
        raise ValueError(f"linear_num_value_heads = {v_heads}: a multiple of linear_num_key_heads ({k_heads}) is "
                         f"required")
    return dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=kv_heads, head_dim=head_dim,
                vocab_size=shared.positive_int(config, "vocab_size"), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope["rope_theta"]), partial_rotary_factor=factor,
                max_seq_len=int(config.get("max_position_embeddings", 32768)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                linear_k_heads=k_heads, linear_v_heads=v_heads,
                linear_k_dim=shared.positive_int({"linear_key_head_dim": 128, **config}, "linear_key_head_dim"),
                linear_v_dim=shared.positive_int({"linear_value_head_dim": 128, **config}, "linear_value_head_dim"),
                conv_kernel=shared.positive_int({"linear_conv_kernel_dim": 4, **config}, "linear_conv_kernel_dim"),
                layer_types=layer_types(config, n_layers))


def common_config(args, architecture: str, model_type: str, bos_id, eos_id) -> dict:
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor}
    out = shared.decoder_config(args, architecture, model_type, rope, args.max_seq_len, bos_id, eos_id)
    return {**out, "linear_num_key_heads": args.linear_k_heads, "linear_num_value_heads": args.linear_v_heads,
            "linear_key_head_dim": args.linear_k_dim, "linear_value_head_dim": args.linear_v_dim,
            "linear_conv_kernel_dim": args.conv_kernel, "layer_types": list(args.layer_types)}
