"""Hugging Face <-> Tessera for Qwen 3 MoE (`Qwen3MoeForCausalLM`): the hub's per-expert tensors are stacked here
(`experts.w1[e]` is expert e's gate_proj); the rest are Qwen 3's names."""

import re

from tessera.models.common import hf as shared
from tessera.models.qwen3.moe.args import Qwen3MoeArgs

_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_NAMES = shared.Renamer("Qwen 3 MoE", {**shared.DECODER_LAYER, "attention.q_norm": "self_attn.q_norm",
                                       "attention.k_norm": "self_attn.k_norm", "feed_forward.router.gate": "mlp.gate"},
                        shared.DECODER_TOP)
_OURS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight")


def to_hf(state: dict) -> dict:
    """Stacked experts become the hub's per-expert tensors, as views of ours (loading fills them in place).
    The selection bias of aux-loss-free balancing has no place in HF's format: it is left out (it is 0 unless
    moe.load_balance_rate trained it; transformers then routes without it)."""
    out = {}
    for name, value in state.items():
        if name.endswith("feed_forward.expert_bias"):
            continue
        m = _OURS.fullmatch(name)
        if m is None:
            out.update(_NAMES.to_hf({name: value}))
            continue
        for e, expert in shared.experts_of(value):
            out[f"model.layers.{m[1]}.mlp.experts.{e}.{_PROJ[m[2]]}.weight"] = expert
    return out


def from_hf(state: dict) -> dict:
    out, experts = {}, {}
    back = {v: k for k, v in _PROJ.items()}
    for name, value in state.items():
        m = _THEIRS.fullmatch(name)
        if m is None:
            out.update(_NAMES.from_hf({name: value}))
        else:
            experts.setdefault(f"layers.{m[1]}.feed_forward.experts.{back[m[3]]}", {})[int(m[2])] = value
    return {**out, **shared.stack_all(experts)}


def args_from_hf_config(config: dict) -> Qwen3MoeArgs:
    """A `Qwen3MoeForCausalLM` config.json, with experts in any pattern of blocks (as transformers picks them:
    block i unless i is in mlp_only_layers, and only if (i + 1) % decoder_sparse_step == 0); sliding windows,
    biases or a RoPE other than plain are refused."""
    shared.refuse_unsupported(config, "qwen3_moe", "qwen3_moe", {"hidden_act": "silu", "attention_bias": False,
                                                          "use_sliding_window": False}, ("default",))
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(type(i) is int and i >= 0 for i in dense):
        raise ValueError(f"mlp_only_layers = {dense!r}: a list of layer indices is required")
    dim, n_heads, kv_heads, head_dim = shared.heads({"head_dim": 128, **config})
    experts = "num_experts" if "num_experts" in config else "num_local_experts"  # transformers 5 writes the latter
    args = Qwen3MoeArgs(dim=dim, n_layers=shared.positive_int(config, "num_hidden_layers"), n_heads=n_heads,
                        n_kv_heads=kv_heads, head_dim=head_dim, vocab_size=shared.positive_int(config, "vocab_size"),
                        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                        rope_theta=float(shared.rope_parameters({"rope_theta": 10000.0, **config})["rope_theta"]),
                        max_seq_len=int(config.get("max_position_embeddings", 32768)),
                        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                        n_experts=shared.positive_int(config, experts),
                        top_k=shared.positive_int(config, "num_experts_per_tok"),
                        moe_hidden=shared.positive_int(config, "moe_intermediate_size"),
                        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                        sparse_step=shared.positive_int({"decoder_sparse_step": 1, **config}, "decoder_sparse_step"),
                        dense_layers=sorted(set(dense)))
    if len(args.moe.layers) < args.n_layers:  # a dense block: its width is intermediate_size
        args.ffn_hidden = shared.positive_int(config, "intermediate_size")
    return args


def hf_config(args: Qwen3MoeArgs, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' Qwen3MoeForCausalLM."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    return {**shared.decoder_config(args, "Qwen3MoeForCausalLM", "qwen3_moe", rope, args.max_seq_len, bos_id, eos_id),
            "use_sliding_window": False, "decoder_sparse_step": args.sparse_step,
            "mlp_only_layers": list(args.dense_layers),
            "num_experts": args.n_experts, "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_hidden,
            "norm_topk_prob": args.norm_topk_prob}


peft_param = shared.fused_expert_param
