"""Hugging Face <-> Tessera for DeepSeek V3 (`DeepseekV3ForCausalLM`): MLA's projections, the hub's per-expert
tensors stacked here, and the router's selection bias (HF `e_score_correction_bias`). FP8 block-quantized
checkpoints are dequantized as they are read (tessera.checkpoint.hf).

Kimi K2 is DeepSeek V3's architecture: its folders (`kimi_k2`, and the text model of a multimodal Kimi K2.5
`kimi_k25` folder, `Kimi_K25ForConditionalGeneration`) load here. A K2.5 folder holds the text model under
`language_model.model.` (transformers' save_pretrained names its blocks `blocks.N`, which transformers reads back as
`layers.N`) and `language_model.lm_head.`, beside a vision tower and projector that are not ours (left out, one
line); its config.json keeps the text model's in text_config and ties the head by its own tie_word_embeddings.
Exports are `DeepseekV3ForCausalLM` folders."""

import dataclasses
import re

from tessera.models.common import hf as shared
from tessera.models.deepseek.v3.args import DeepSeekV3Args

_LAYER = {**{k: v for k, v in shared.DECODER_LAYER.items() if not k.startswith("attention.")},
          "attention.wq": "self_attn.q_proj", "attention.wq_a": "self_attn.q_a_proj",
          "attention.q_norm": "self_attn.q_a_layernorm", "attention.wq_b": "self_attn.q_b_proj",
          "attention.wkv_a": "self_attn.kv_a_proj_with_mqa", "attention.kv_norm": "self_attn.kv_a_layernorm",
          "attention.wkv_b": "self_attn.kv_b_proj", "attention.wo": "self_attn.o_proj",
          "feed_forward.router.gate": "mlp.gate", "feed_forward.shared.w1": "mlp.shared_experts.gate_proj",
          "feed_forward.shared.w2": "mlp.shared_experts.down_proj",
          "feed_forward.shared.w3": "mlp.shared_experts.up_proj",
          **{f"attention.indexer.{n}": f"self_attn.indexer.{n}" for n in ("wq_b", "wk", "k_norm", "weights_proj")}}
_NAMES = shared.Renamer("DeepSeek V3", _LAYER, shared.DECODER_TOP)
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OURS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight")
_BIAS = (re.compile(r"layers\.(\d+)\.feed_forward\.expert_bias"),
         re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias"))


ALSO_READS = ("kimi_k2", "kimi_k25", "deepseek_v32", "glm_moe_dsa")
_SPARSE = ("deepseek_v32", "glm_moe_dsa")  # DSA's model types: V3.2's, GLM-5's
_TEXT = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."}
_VISION = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def stored_names(names) -> dict:
    """{name in a folder: its to_hf name, or None}: a Kimi K2.5 folder's text model under DeepSeek V3's names, its
    vision tower and projector None."""
    out = {}
    for name in names:
        prefix = next((p for p in _TEXT if name.startswith(p)), None)
        if prefix is not None:
            out[name] = _TEXT[prefix] + re.sub(r"^blocks\.", "layers.", name.removeprefix(prefix))
        else:
            out[name] = None if name.startswith(_VISION) else name
    return out


def text_config(config: dict) -> dict:
    """A Kimi K2.5 config.json's text model (its tie_word_embeddings the top level's, transformers' default True),
    a Kimi K2 one's, as DeepSeek V3's."""
    if config.get("model_type") == "kimi_k25":
        if not isinstance(config.get("text_config"), dict):
            raise ValueError("text_config is not a table: a Kimi K2.5 config.json holds its text model's there")
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", True)}
    return {**config, "model_type": "deepseek_v3"} if config.get("model_type") in ("kimi_k2", *_SPARSE) else config


_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight"}  # ours -> theirs, under model.layers.{L + k}
# DeepSeek's checkpoints give each MTP layer copies of the embedding and the output head, which it shares.
_MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}


def to_hf(state: dict) -> dict:
    """MTP depth k is HF's layer L + k (L blocks): the block's tensors named as a layer's, its own beside them."""
    n_layers = 1 + max((int(m[1]) for n in state if (m := re.match(r"layers\.(\d+)\.", n))), default=-1)
    out = {}
    for name, value in state.items():
        if m := _MTP.fullmatch(name):
            layer, rest = n_layers + int(m[1]), m[2]
            if rest in _MTP_OWN:
                out[f"model.layers.{layer}.{_MTP_OWN[rest]}"] = value
            else:
                out.update(_layer_to_hf(f"layers.{layer}.{rest.removeprefix('block.')}", value))
            if rest == "norm.weight":
                # Fresh tensors: safetensors refuses shared storage; read back, they fold into the originals.
                out.update({f"model.layers.{layer}.{k}": state[v].clone() for k, v in _MTP_COPIES.items()
                            if v in state})
        else:
            out.update(_layer_to_hf(name, value))
    return out


def _layer_to_hf(name: str, value) -> dict:
    if m := _BIAS[0].fullmatch(name):
        return {f"model.layers.{m[1]}.mlp.gate.e_score_correction_bias": value}
    if m := _OURS.fullmatch(name):
        return {f"model.layers.{m[1]}.mlp.experts.{e}.{_PROJ[m[2]]}.weight": expert
                for e, expert in shared.experts_of(value)}
    return _NAMES.to_hf({name: value})


def from_hf(state: dict) -> dict:
    mtp_layers = [int(m[1]) for n in state if (m := re.fullmatch(r"model\.layers\.(\d+)\.eh_proj\.weight", n))]
    first_mtp = min(mtp_layers, default=None)
    out, experts = {}, {}
    back, own = {v: k for k, v in _PROJ.items()}, {v: k for k, v in _MTP_OWN.items()}
    for name, value in state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        depth = int(m[1]) - first_mtp if m and first_mtp is not None and int(m[1]) >= first_mtp else None
        if depth is not None and m[2] in own:
            out[f"mtp.{depth}.{own[m[2]]}"] = value
        elif depth is not None and m[2] in _MTP_COPIES:
            out[_MTP_COPIES[m[2]]] = value
        elif m := _BIAS[1].fullmatch(name):
            out[_in_depth(f"layers.{m[1]}.feed_forward.expert_bias", first_mtp)] = value
        elif m := _THEIRS.fullmatch(name):
            key = _in_depth(f"layers.{m[1]}.feed_forward.experts.{back[m[3]]}", first_mtp)
            experts.setdefault(key, {})[int(m[2])] = value
        else:
            out.update({_in_depth(k, first_mtp): v for k, v in _NAMES.from_hf({name: value}).items()})
    return {**out, **shared.stack_all(experts)}


def _in_depth(name: str, first_mtp: int | None) -> str:
    """A block tensor of layer L + k -> the MTP depth k's block."""
    m = re.match(r"layers\.(\d+)\.(.+)", name)
    if m is None or first_mtp is None or int(m[1]) < first_mtp:
        return name
    return f"mtp.{int(m[1]) - first_mtp}.block.{m[2]}"


def args_from_hf_config(config: dict) -> DeepSeekV3Args:
    """A `DeepseekV3ForCausalLM` config.json; biases, another activation, RoPE other than plain or YaRN, and
    key/value heads apart from the query heads are refused. Its MTP layers (num_nextn_predict_layers, or
    transformers' num_mtp_layers) are built: their weights are layers L, L + 1... (see fit_to_weights). Kimi K2
    and K2.5 configs: text_config."""
    kind = config.get("model_type")
    sparse = kind in _SPARSE
    config = text_config(_v32(config) if sparse else config)
    shared.refuse_unsupported(config, "deepseek_v3", "deepseek_v3", {"hidden_act": "silu", "attention_bias": False},
                              ("default", "yarn"))
    heads = shared.positive_int(config, "num_attention_heads")
    if config.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads = {config['num_key_value_heads']}: MLA expands keys and values for "
                         f"every one of the {heads} heads")
    rope = shared.rope_parameters({"rope_theta": 10000.0, **config})
    yarn = {"rope_type": "yarn", **{k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}} \
        if rope["rope_type"] == "yarn" else None
    experts = "n_routed_experts" if "n_routed_experts" in config else "num_local_experts"
    return DeepSeekV3Args(
        dim=shared.positive_int(config, "hidden_size"), n_layers=shared.positive_int(config, "num_hidden_layers"),
        n_heads=heads, q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=shared.positive_int(config, "kv_lora_rank"),
        qk_nope_head_dim=shared.positive_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=shared.positive_int(config, "qk_rope_head_dim"),
        v_head_dim=shared.positive_int(config, "v_head_dim"),
        ffn_hidden=shared.positive_int(config, "intermediate_size"),
        moe_hidden=shared.positive_int(config, "moe_intermediate_size"), n_experts=shared.positive_int(config, experts),
        n_shared=int(config.get("n_shared_experts") or 0), top_k=shared.positive_int(config, "num_experts_per_tok"),
        score_func="sigmoid", n_groups=int(config.get("n_group") or 1), top_groups=int(config.get("topk_group") or 1),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        first_k_dense=int(config.get("first_k_dense_replace") or 0),
        vocab_size=shared.positive_int(config, "vocab_size"),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]), rope_scaling=yarn,
        rope_interleave=bool(config.get("rope_interleave", True)),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        n_mtp=int(config.get("num_nextn_predict_layers", config.get("num_mtp_layers")) or 0),
        **({"index_topk": shared.positive_int({"index_topk": 2048, **config}, "index_topk"),
            "index_n_heads": shared.positive_int({"index_n_heads": 64, **config}, "index_n_heads"),
            "index_head_dim": shared.positive_int({"index_head_dim": 128, **config}, "index_head_dim")}
           if sparse else {}),
        **({"index_rope_interleave": True, "index_shared": _shared_blocks(config)} if kind == "glm_moe_dsa" else {}))


def _shared_blocks(config: dict) -> list[int]:
    """GLM-5's blocks without an indexer: indexer_types "shared", or as transformers derives them (a pattern of F
    and S, or a full block every index_topk_freq from index_skip_topk_offset)."""
    n = shared.positive_int(config, "num_hidden_layers")
    kinds = config.get("indexer_types")
    if kinds is None and (pattern := config.get("index_topk_pattern")) is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if kinds is None:
        freq, offset = max(int(config.get("index_topk_freq", 1)), 1), int(config.get("index_skip_topk_offset", 2))
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full", "shared"} or kinds[:1] != ["full"]:
        raise ValueError(f"indexer_types = {kinds}: one of 'full' or 'shared' per layer ({n}), the first full")
    return [i for i, k in enumerate(kinds) if k == "shared"]


def _v32(config: dict) -> dict:
    """DeepSeek V3.2's config: a query bottleneck (its indexer reads it), and dense blocks first (mlp_layer_types:
    its first_k_dense_replace)."""
    if not config.get("q_lora_rank"):
        raise ValueError("q_lora_rank: DeepSeek V3.2's indexer reads the query's bottleneck; a config without one "
                         "is no V3.2 model")
    kinds = config.get("mlp_layer_types")
    if kinds is not None:
        dense = kinds.count("dense")
        if kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense):
            raise ValueError(f"mlp_layer_types = {kinds}: Tessera builds the dense blocks first, then the MoE ones")
        return {**config, "first_k_dense_replace": dense}
    return config


def fit_to_weights(args: DeepSeekV3Args, names: set[str], train: bool) -> tuple[DeepSeekV3Args, tuple, str | None]:
    """transformers declares MTP depths (num_nextn_predict_layers, 1 by default) but neither builds nor saves
    them: a folder holding no tensor of layers L, L + 1... (every fine-tune or conversion transformers wrote)
    loads without them, or with them freshly initialized for a run that trains them (`train`). A folder holding
    part of them keeps them, so that the load names what it lacks. (args, prefixes left as initialized, note)."""
    mapped = stored_names(names)
    vision = sorted(n for n, ours in mapped.items() if ours is None)
    note = f"{len(vision)} tensors of the vision tower and projector ({vision[0]}, ...) are not the text model's: " \
           f"not loaded" if vision else None
    layers = {int(m[1]) for n in mapped.values() if n and (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if not args.n_mtp or max(layers, default=-1) >= args.n_layers:
        return args, (), note
    lacks = (f"config.json declares {args.n_mtp} MTP depth(s) (num_nextn_predict_layers) but the folder holds none "
             f"of their weights (model.layers.{args.n_layers}...; transformers saves none)")
    if train:
        return args, ("mtp.",), f"{lacks}: they start freshly initialized"
    return dataclasses.replace(args, n_mtp=0), (), f"{lacks}: loaded without them"


def hf_config(args: DeepSeekV3Args, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' DeepseekV3ForCausalLM (sigmoid routing; a softmax-scored V2 flavor has no
    such config and is refused)."""
    if args.score_func != "sigmoid":
        raise ValueError(f"score_func = {args.score_func!r}: DeepseekV3ForCausalLM scores experts with a sigmoid")
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(args.rope_scaling or {})}
    max_pos = args.max_seq_len
    if args.rope_scaling:
        max_pos = int(args.rope_scaling["original_max_position_embeddings"] * args.rope_scaling["factor"])
    sparse = {"index_topk": args.index_topk, "index_n_heads": args.index_n_heads,
              "index_head_dim": args.index_head_dim} if args.index_topk else {}
    kind = ("DeepseekV3ForCausalLM", "deepseek_v3")
    if args.index_topk:
        kind = ("GlmMoeDsaForCausalLM", "glm_moe_dsa") if args.index_rope_interleave else \
            ("DeepseekV32ForCausalLM", "deepseek_v32")
        if args.index_rope_interleave:
            sparse["indexer_types"] = ["shared" if i in args.index_shared else "full" for i in range(args.n_layers)]
    return {**shared.decoder_config(args, *kind, rope, max_pos, bos_id, eos_id), **sparse,
            "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim, "head_dim": args.qk_rope_head_dim, "moe_intermediate_size": args.moe_hidden,
            "n_routed_experts": args.n_experts, "n_shared_experts": args.n_shared,
            "num_experts_per_tok": args.top_k, "n_group": args.n_groups, "topk_group": args.top_groups,
            "routed_scaling_factor": args.route_scale, "norm_topk_prob": args.norm_topk_prob,
            "first_k_dense_replace": args.first_k_dense, "rope_interleave": args.rope_interleave,
            "num_nextn_predict_layers": args.n_mtp}


peft_param = shared.fused_expert_param
