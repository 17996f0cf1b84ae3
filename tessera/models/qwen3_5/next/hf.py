"""Hugging Face <-> Tessera for Qwen3-Next (`Qwen3NextForCausalLM`): Qwen 3.5 MoE's names and layouts
(tessera/models/qwen3_5/hf.py, the MTP head of a release carried), but for DeltaNet's input projections, which
Qwen3-Next fuses per key head: `in_proj_qkvz` holds, key head after key head, its q rows (linear_key_head_dim), its
k rows, then the v rows and the z rows of its value heads (linear_value_head_dim each); `in_proj_ba` the b rows then
the a rows of its value heads. Splitting them needs the key heads, so loading and exports use the adapter bound to
the model's args (`bind`); the unbound `to_hf` / `from_hf` map every other tensor."""

from types import SimpleNamespace

from tessera.models.common import hf as shared
from tessera.models.qwen3_5 import hf as group
from tessera.models.qwen3_5.next.args import Qwen3NextArgs

MODEL_TYPE = "qwen3_next"
stored_names, fit_to_weights, carried = group.stored_names, group.fit_to_weights, group.CARRIED
_LINEAR = "model.layers.{}.linear_attn."


def _interleave(parts: list, rows: list[int], heads: int):
    """Tensors of heads x rows[i] rows each -> one whose rows go head by head, each head's rows of every part in
    turn (None for None)."""
    import torch

    if parts[0] is None:
        return None
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(heads, n, *rest) for p, n in zip(parts, rows, strict=True)], dim=1).reshape(-1, *rest)


def _deinterleave(value, rows: list[int], heads: int) -> list:
    if value is None:
        return [None] * len(rows)
    rest = value.shape[1:]
    return [x.reshape(-1, *rest) for x in value.reshape(heads, sum(rows), *rest).split(rows, dim=1)]


def _layers(state: dict, leaf: str) -> list[str]:
    return sorted({n.split(".")[2] for n in state if n.endswith(f".linear_attn.{leaf}.weight")}, key=int)


def _per_key_head(args) -> tuple[int, list[int], list[int]]:
    """(key heads, rows of q, k, v, z per key head, rows of b, a per key head)."""
    r = args.linear_v_heads // args.linear_k_heads
    dk, dv = args.linear_k_dim, args.linear_v_dim
    return args.linear_k_heads, [dk, dk, r * dv, r * dv], [r, r]


def _fuse(state: dict, args) -> dict:
    """Qwen 3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a -> Qwen3-Next's in_proj_qkvz and in_proj_ba."""
    heads, qkvz, ba = _per_key_head(args)
    out = dict(state)
    for layer in _layers(state, "in_proj_qkv"):
        at = _LINEAR.format(layer) + "{}.weight"
        qkv, z = out.pop(at.format("in_proj_qkv")), out.pop(at.format("in_proj_z"))
        out[at.format("in_proj_qkvz")] = _interleave([*_split_qkv(qkv, heads * qkvz[0]), z], qkvz, heads)
        b, a = out.pop(at.format("in_proj_b")), out.pop(at.format("in_proj_a"))
        out[at.format("in_proj_ba")] = _interleave([b, a], ba, heads)
    return out


def _split_qkv(qkv, qk_rows: int) -> list:
    if qkv is None:
        return [None] * 3
    return list(qkv.split([qk_rows, qk_rows, qkv.shape[0] - 2 * qk_rows]))


def _unfuse(state: dict, args) -> dict:
    import torch

    heads, qkvz, ba = _per_key_head(args)
    out = dict(state)
    for layer in _layers(state, "in_proj_qkvz"):
        at = _LINEAR.format(layer) + "{}.weight"
        q, k, v, z = _deinterleave(out.pop(at.format("in_proj_qkvz")), qkvz, heads)
        out[at.format("in_proj_qkv")] = None if q is None else torch.cat([q, k, v])
        out[at.format("in_proj_z")] = z
        out[at.format("in_proj_b")], out[at.format("in_proj_a")] = _deinterleave(out.pop(at.format("in_proj_ba")),
                                                                                 ba, heads)
    return out


def bind(args: Qwen3NextArgs) -> SimpleNamespace:
    """to_hf, to_hf_for and from_hf for a model of `args` (its DeltaNet key heads split the fused projections)."""
    return SimpleNamespace(to_hf=lambda state: _fuse(group.to_hf(state), args),
                           to_hf_for=lambda names: lambda state: _fuse(group.to_hf_for(names)(state), args),
                           from_hf=lambda state: group.from_hf(_unfuse(state, args)))


def to_hf(state: dict) -> dict:
    """Unbound: every tensor but DeltaNet's input projections, which need `bind`."""
    return {k: v for k, v in group.to_hf(state).items() if ".linear_attn.in_proj_" not in k}


def from_hf(state: dict) -> dict:
    return group.from_hf({k: v for k, v in state.items() if ".linear_attn.in_proj_" not in k})


def args_from_hf_config(config: dict) -> Qwen3NextArgs:
    """A `Qwen3NextConfig` config.json: experts in every decoder_sparse_step-th block but the mlp_only_layers."""
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"mlp_only_layers = {dense!r}: a list of block indices")
    common = group.common_args({k: v for k, v in config.items() if k != "mlp_only_layers"}, "qwen3_next",
                               MODEL_TYPE)
    return Qwen3NextArgs(**common, n_experts=shared.positive_int(config, "num_experts"),
                         top_k=shared.positive_int(config, "num_experts_per_tok"),
                         moe_hidden=shared.positive_int(config, "moe_intermediate_size"),
                         shared_hidden=shared.positive_int(config, "shared_expert_intermediate_size"),
                         ffn_hidden=shared.positive_int({"intermediate_size": 5632, **config}, "intermediate_size"),
                         decoder_sparse_step=shared.positive_int({"decoder_sparse_step": 1, **config},
                                                                 "decoder_sparse_step"),
                         mlp_only_layers=dense, norm_topk_prob=bool(config.get("norm_topk_prob", True)))


def hf_config(args: Qwen3NextArgs, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' Qwen3NextForCausalLM."""
    out = group.common_config(args, "Qwen3NextForCausalLM", MODEL_TYPE, bos_id, eos_id)
    return {**out, "num_experts": args.n_experts, "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.moe_hidden, "shared_expert_intermediate_size": args.shared_hidden,
            "intermediate_size": args.ffn_hidden, "decoder_sparse_step": args.decoder_sparse_step,
            "mlp_only_layers": list(args.mlp_only_layers), "norm_topk_prob": args.norm_topk_prob}
