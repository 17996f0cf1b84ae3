"""Hugging Face <-> Tessera for DeepSeek V4 (`DeepseekV4ForCausalLM`), in the release's tensor names (DeepSeek's:
`embed`, `layers.N.attn.wq_a`, `attn.kv_norm`, `attn.attn_sink`, `attn.compressor.ape`, `ffn.experts.E.w1`,
`hc_attn_fn`, `head`, ...), which transformers converts on load. transformers' save_pretrained writes the same names
under `model.` (but `head`), the key/value norm as `attn.norm`: both load; exports write the release's. Our names
follow the release's, so the table is short. The release's multi-token prediction depths are `mtp.K.*`: a block's
names and the depth's own (`e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`, `hc_head_fn`...); the copies of the
embedding and the head that some releases keep beside them (`mtp.K.emb.tok_emb`, `mtp.K.head`) are not read
(the model's own are). transformers neither builds nor saves the depths (see fit_to_weights). The release's FP8
blocks and FP4 experts are dequantized as they are read (tessera.checkpoint.dequantize)."""

import dataclasses
import re

from tessera.models.common import hf as shared
from tessera.models.deepseek.v4.args import CSA, HASH, HCA, SLIDING, TOPK, DeepSeekV4Args, default_layer_types

MODEL_TYPE = "deepseek_v4"
_TOP = {"tok_embeddings.weight": "embed.weight", "norm.weight": "norm.weight", "output.weight": "head.weight",
        **{f"hc_head.{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}}
_LAYER = {"attention_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
          **{f"{ours}_hc.{p}": f"hc_{theirs}_{p}" for ours, theirs in (("attention", "attn"), ("ffn", "ffn"))
             for p in ("fn", "base", "scale")},
          "attention.kv.wkv.weight": "attn.wkv.weight", "attention.kv.norm.weight": "attn.kv_norm.weight",
          "attention.sdpa.sinks": "attn.attn_sink", "feed_forward.router.gate.weight": "ffn.gate.weight",
          "feed_forward.expert_bias": "ffn.gate.bias", "feed_forward.hash_experts": "ffn.gate.tid2eid",
          **{f"feed_forward.shared.{w}.weight": f"ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}}
_BACK = {v: k for k, v in _LAYER.items()} | {"attn.norm.weight": "attention.kv.norm.weight"}  # save_pretrained's
# Our block's names under layers.N, or a depth's under mtp.K.block (theirs: under mtp.K, beside the depth's own).
_LAYER_NAME = re.compile(r"(layers\.\d+|mtp\.\d+\.block)\.(.+)")
_THEIR_LAYER = re.compile(r"(layers\.\d+|mtp\.\d+)\.(.+)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_DEPTH = {**{f"{w}.weight": f"{w}.weight" for w in ("enorm", "hnorm", "norm", "e_proj", "h_proj")},
          **{f"hc_head.{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}}  # a depth's own: ours -> theirs
_DEPTH_BACK = {v: k for k, v in _DEPTH.items()}
_COPIES = ("emb.tok_emb.weight", "head.weight")  # a depth's copies of the embedding and the head


def stored_names(names) -> dict:
    """{name in a folder: its to_hf name}: transformers' save_pretrained prefixes the release's names with
    `model.`; a depth's copies of the embedding and the head are not the model's (None)."""
    out = {}
    for name in names:
        bare = name.removeprefix("model.")
        copy = bare.startswith("mtp.") and bare.split(".", 2)[2] in _COPIES
        out[name] = None if copy else {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                                       "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"
                                       }.get(bare, bare)
    return out


def to_hf(state: dict) -> dict:
    """Experts one tensor each (views of our stacks); a hash-routed block's selection bias is not stored."""
    hashed = {m[1] for name in state if (m := _LAYER_NAME.fullmatch(name)) and m[2] == "feed_forward.hash_experts"}
    out = {}
    for name, value in state.items():
        if (depth := re.fullmatch(r"(mtp\.\d+)\.(.+)", name)) and depth[2] in _DEPTH:
            out[f"{depth[1]}.{_DEPTH[depth[2]]}"] = value
            continue
        m = _LAYER_NAME.fullmatch(name)
        if m is None:
            out[_TOP[name]] = value
            continue
        layer, part = m[1].removesuffix(".block"), m[2]
        if part == "feed_forward.expert_bias" and m[1] in hashed:
            continue
        if ex := re.fullmatch(r"feed_forward\.experts\.(w[123])", part):
            out.update({f"{layer}.ffn.experts.{e}.{ex[1]}.weight": t for e, t in shared.experts_of(value)})
        else:
            out[f"{layer}.{_LAYER.get(part) or _attention_to_hf(part)}"] = value
    return out


def to_hf_for(names) -> callable:
    """The to_hf of a folder holding `names`: the release's, or save_pretrained's key/value norm (`attn.norm`)."""
    if not any(n.endswith(".attn.norm.weight") for n in names):
        return to_hf
    return lambda state: {re.sub(r"\.attn\.kv_norm\.weight$", ".attn.norm.weight", k): v
                          for k, v in to_hf(state).items()}


def _attention_to_hf(part: str) -> str:
    """attention.wq_a.weight -> attn.wq_a.weight, ... (the same names under `attn.`)."""
    if not part.startswith("attention."):
        raise KeyError(f"no DeepSeek V4 mapping for parameter '{part}'")
    return "attn." + part.removeprefix("attention.")


def from_hf(state: dict) -> dict:
    out, experts = {}, {}
    top = {v: k for k, v in _TOP.items()}
    for name, value in state.items():
        m = _THEIR_LAYER.fullmatch(name)
        if m is None:
            out[top[name]] = value
            continue
        part = m[2]
        if m[1].startswith("mtp.") and part in _DEPTH_BACK:
            out[f"{m[1]}.{_DEPTH_BACK[part]}"] = value
            continue
        block = m[1] + (".block" if m[1].startswith("mtp.") else "")
        if ex := _EXPERT.fullmatch(part):
            experts.setdefault(f"{block}.feed_forward.experts.{ex[2]}", {})[int(ex[1])] = value
        elif part in _BACK:
            out[f"{block}.{_BACK[part]}"] = value
        else:
            out[f"{block}.attention.{part.removeprefix('attn.')}"] = value
    return {**out, **shared.stack_all(experts)}


def _layer_types(config: dict, n_layers: int, rates: dict) -> list[str]:
    """Every block's attention, the MTP depths' after the trunk's where the config lists them (the release's
    compress_ratios: one more entry per depth)."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    if config.get("compress_ratios"):  # the release's: a compression rate per block (0: sliding)
        by_rate = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        unknown = set(config["compress_ratios"]) - set(by_rate)
        if unknown:
            raise ValueError(f"compress_ratios holds {sorted(unknown)}: each must be 0, the CSA rate {rates[CSA]} or "
                             f"the HCA rate {rates[HCA]}")
        return [by_rate[r] for r in config["compress_ratios"]]
    return default_layer_types(n_layers)


def args_from_hf_config(config: dict) -> DeepSeekV4Args:
    """A `DeepseekV4Config` config.json: transformers' fields, or the release's older names (compress_ratios,
    compress_rate_csa / _hca, num_hash_layers, qk_rope_head_dim)."""
    shared.refuse_unsupported(config, MODEL_TYPE, MODEL_TYPE, {"hidden_act": "silu", "attention_bias": False,
                                                              "mlp_bias": False, "num_key_value_heads": 1,
                                                              "n_shared_experts": 1},  # transformers' V4 builds one
                              ("default", "yarn"))
    n_layers, head_dim = shared.positive_int(config, "num_hidden_layers"), config.get("head_dim", 512)
    n_mtp = int(config.get("num_nextn_predict_layers") or 0)
    rates = {CSA: 4, HCA: 128, **(config.get("compress_rates") or {})}
    rates[CSA] = config.get("compress_rate_csa", rates[CSA])
    rates[HCA] = config.get("compress_rate_hca", rates[HCA])
    hashed = config.get("num_hash_layers", 3)
    mlp = list(config.get("mlp_layer_types") or [HASH if i < hashed else TOPK for i in range(n_layers)])[:n_layers]
    factor = config.get("partial_rotary_factor")
    rope_dim = int(head_dim * factor) if factor else config.get("qk_rope_head_dim", head_dim // 8)
    rope = config.get("rope_parameters") or {}
    main = rope.get("main") or {"rope_theta": config.get("rope_theta", 10000.0)}
    compress = rope.get("compress") or {**{k: v for k, v in rope.items() if k not in ("main", "compress")},
                                        "rope_theta": config.get("compress_rope_theta", 160000.0)}
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in ("default", "yarn") or main.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters = {rope!r}: Tessera's deepseek_v4 computes plain RoPE for sliding blocks, "
                         f"plain or YaRN for compressed ones")
    yarn = {"rope_type": "yarn", "attention_factor": 1.0,  # transformers' V4: no YaRN temperature by default
            **{k: v for k, v in compress.items() if k not in ("rope_type", "type", "rope_theta",
                                                               "partial_rotary_factor")}} if kind == "yarn" else None
    ints = {k: shared.positive_int({"v": config.get(key, default)}, "v") for k, key, default in (
        ("n_heads", "num_attention_heads", 64), ("q_lora_rank", "q_lora_rank", 1024), ("o_groups", "o_groups", 8),
        ("o_lora_rank", "o_lora_rank", 1024), ("window", "sliding_window", 128),
        ("index_n_heads", "index_n_heads", 64), ("index_head_dim", "index_head_dim", 128),
        ("index_topk", "index_topk", 512), ("hc_mult", "hc_mult", 4), ("hc_sinkhorn_iters", "hc_sinkhorn_iters", 20),
        ("moe_hidden", "moe_intermediate_size", 2048), ("n_experts", "n_routed_experts", 256),
        ("top_k", "num_experts_per_tok", 6))}
    kinds = _layer_types(config, n_layers, rates)
    return DeepSeekV4Args(
        dim=shared.positive_int(config, "hidden_size"), n_layers=n_layers, head_dim=head_dim, rope_head_dim=rope_dim,
        **ints, layer_types=kinds[:n_layers], csa_rate=int(rates[CSA]), n_mtp=n_mtp,
        mtp_layer_types=kinds[n_layers:n_layers + n_mtp] if len(kinds) >= n_layers + n_mtp else [],
        hca_rate=int(rates[HCA]), hc_eps=float(config.get("hc_eps", 1e-6)),
        n_shared=1, score_func=config.get("scoring_func", "sqrtsoftplus"),
        route_scale=float(config.get("routed_scaling_factor", 1.5)),
        norm_topk_prob=True, mlp_layer_types=mlp,  # transformers' V4 routers renormalize whatever it says
        swiglu_limit=float(config.get("swiglu_limit", 10.0)), vocab_size=shared.positive_int(config, "vocab_size"),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(main.get("rope_theta", 10000.0)),
        compress_rope_theta=float(compress.get("rope_theta", 160000.0)), rope_scaling=yarn,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def hf_config(args: DeepSeekV4Args, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' DeepseekV4ForCausalLM; layer_types lists the MTP depths' blocks after the
    trunk's, as the release's compress_ratios does (transformers reads the trunk's)."""
    factor = args.rope_head_dim / args.head_dim
    compress = {"rope_type": "default", **(args.rope_scaling or {}), "rope_theta": args.compress_rope_theta,
                "partial_rotary_factor": factor}
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": MODEL_TYPE, "hidden_size": args.dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": 1,
            "head_dim": args.head_dim, "partial_rotary_factor": factor, "q_lora_rank": args.q_lora_rank,
            "o_groups": args.o_groups, "o_lora_rank": args.o_lora_rank, "sliding_window": args.window,
            "layer_types": args.layer_types + args.mtp_layer_types, "num_nextn_predict_layers": args.n_mtp,
            "compress_rates": {CSA: args.csa_rate, HCA: args.hca_rate},
            "index_n_heads": args.index_n_heads, "index_head_dim": args.index_head_dim,
            "index_topk": args.index_topk, "hc_mult": args.hc_mult, "hc_sinkhorn_iters": args.hc_sinkhorn_iters,
            "hc_eps": args.hc_eps, "moe_intermediate_size": args.moe_hidden, "n_routed_experts": args.n_experts,
            "n_shared_experts": args.n_shared, "num_experts_per_tok": args.top_k, "scoring_func": args.score_func,
            "routed_scaling_factor": args.route_scale, "norm_topk_prob": args.norm_topk_prob,
            "mlp_layer_types": args.mlp_layer_types, "swiglu_limit": args.swiglu_limit,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "compress_rope_theta": args.compress_rope_theta,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": args.rope_theta,
                                         "partial_rotary_factor": factor}, "compress": compress},
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
            "bos_token_id": bos_id, "eos_token_id": eos_id, "hidden_act": "silu", "attention_bias": False,
            "pad_token_id": None, "torch_dtype": "float32"}


def fit_to_weights(args: DeepSeekV4Args, names: set[str], train: bool) -> tuple[DeepSeekV4Args, tuple, str | None]:
    """transformers declares MTP depths (num_nextn_predict_layers, 1 by default) but neither builds nor saves
    them: a folder holding no `mtp.` tensor (every one transformers wrote) loads without them, or with them freshly
    initialized for a run that trains them (`train`). A release holds them (`mtp.K.*`) and keeps them.
    (args, prefixes left as initialized, note)."""
    if not args.n_mtp or any(n and n.startswith("mtp.") for n in stored_names(names).values()):
        return args, (), None
    lacks = (f"config.json declares {args.n_mtp} MTP depth(s) (num_nextn_predict_layers) but the folder holds none "
             f"of their weights (mtp.0...; transformers saves none)")
    if train:
        return args, ("mtp.",), f"{lacks}: they start freshly initialized"
    return dataclasses.replace(args, n_mtp=0, mtp_layer_types=[]), (), f"{lacks}: loaded without them"
