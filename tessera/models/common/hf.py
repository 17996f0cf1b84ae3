"""What the decoder families' Hugging Face adapters share: name tables both ways, and reading config.json
values strictly (a value Tessera would not compute the same way is refused, never guessed at)."""

import glob
import json
import os
import re
import struct

# Our block's module names -> transformers' (Llama, Qwen 3, and the many decoders that copied them).
DECODER_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
DECODER_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}


class Renamer:
    """Parameter names between ours and a checkpoint's, from a block table and a top-level table."""

    def __init__(self, family: str, layer: dict[str, str], top: dict[str, str]):
        self.family = family
        self.to = {**{rf"layers\.(\d+)\.{re.escape(k)}\.(weight|bias)": rf"model.layers.\1.{v}.\2"
                      for k, v in layer.items()}, **{re.escape(k): v for k, v in top.items()}}
        self.back = {**{rf"model\.layers\.(\d+)\.{re.escape(v)}\.(weight|bias)": rf"layers.\1.{k}.\2"
                        for k, v in layer.items()}, **{re.escape(v): k for k, v in top.items()}}

    def _rename(self, name: str, table: dict) -> str:
        for pattern, repl in table.items():
            if re.fullmatch(pattern, name):
                return re.sub(pattern, repl, name)
        raise KeyError(f"no {self.family} mapping for parameter '{name}'")

    def to_hf(self, state: dict) -> dict:
        return {self._rename(k, self.to): v for k, v in state.items()}

    def from_hf(self, state: dict) -> dict:
        """Checkpoint names -> ours. A tied model has no output.weight: an `lm_head.weight` beside tied
        embeddings maps to a tensor the model lacks, which the loader refuses rather than drop."""
        return {self._rename(k, self.back): v for k, v in state.items()}


def stored_names(folder: str) -> set[str]:
    """The tensor names the safetensors files in `folder` hold, torch-free: an index's weight map, else each
    file's header. ValueError naming the file when one cannot be read."""
    indexes = glob.glob(os.path.join(folder, "*.safetensors.index.json"))
    paths = indexes or glob.glob(os.path.join(folder, "*.safetensors"))
    names = set()
    for path in paths:
        try:
            with open(path, "rb") as fh:
                if indexes:
                    names |= json.load(fh)["weight_map"].keys()
                else:
                    names |= json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0])).keys() - {"__metadata__"}
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise ValueError(f"cannot read the tensor names in {path}: {type(e).__name__}: {e}") from None
    return names


def positive_int(config: dict, key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} = {value!r}; a positive integer is required")
    return value


def rope_parameters(config: dict) -> dict:
    """transformers 5 keeps rope_theta in rope_parameters; 4.x beside rope_scaling (null when unscaled)."""
    rope = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0),
            **(config.get("rope_parameters") or config.get("rope_scaling") or {})}
    rope["rope_type"] = rope.get("type", rope["rope_type"])
    return rope


def refuse_unsupported(config: dict, family: str, model_type: str, expected: dict, rope_types: tuple[str, ...]):
    """`expected`: key -> the only value (its default when absent) Tessera's `family` computes."""
    if config.get("model_type", model_type) != model_type:
        raise ValueError(f"model_type = {config['model_type']!r}, not {model_type!r}; set model.name to its family")
    other = [f"{k} = {config[k]!r}" for k, want in expected.items() if config.get(k, want) != want]
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type not in rope_types:
        other.append(f"rope_type = {rope_type!r}")
    if other:
        wanted = ", ".join(f"{k} = {v!r}" for k, v in expected.items())
        raise ValueError(f"{', '.join(other)}: Tessera's {family} computes {wanted} and RoPE "
                         f"{' or '.join(rope_types)} only")


def heads(config: dict) -> tuple[int, int, int, int]:
    """(hidden size, heads, key/value heads, head_dim), checked."""
    dim, n_heads = positive_int(config, "hidden_size"), positive_int(config, "num_attention_heads")
    kv_heads = positive_int(config, "num_key_value_heads") if config.get("num_key_value_heads") else n_heads
    head_dim = positive_int(config, "head_dim") if config.get("head_dim") else dim // n_heads
    if n_heads % kv_heads or head_dim % 2:
        raise ValueError(f"num_attention_heads = {n_heads}, num_key_value_heads = {kv_heads}, head_dim = {head_dim}: "
                         f"the heads must be a multiple of the key/value heads, and head_dim even")
    return dim, n_heads, kv_heads, head_dim


def decoder_config(args, architecture: str, model_type: str, rope: dict, max_pos: int, bos_id, eos_id) -> dict:
    """The config.json fields the decoder families share."""
    return {"architectures": [architecture], "model_type": model_type, "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "rope_parameters": rope, "max_position_embeddings": max_pos, "tie_word_embeddings": args.tie_embeddings,
            "bos_token_id": bos_id, "eos_token_id": eos_id, "hidden_act": "silu", "attention_bias": args.attention_bias,
            "torch_dtype": "float32"}


_IN_PLACE = "_tessera_shard_view"  # marks a view of a sharded stack's local experts (filled in place on load)


def experts_of(stack) -> list[tuple[int, object]]:
    """(global expert index, its tensor) of every expert this rank holds of a stacked [E, ...] tensor, as views
    of it: all of a plain one; of a DTensor the local ones (FSDP and EP split the expert dimension only, so a
    rank holds whole experts), marked so that `stack_experts` knows loading filled them in place."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(stack, DTensor):
        return list(enumerate(stack))
    if any(not isinstance(p, Replicate) and not (isinstance(p, (Shard, _StridedShard)) and p.dim == 0)
           for p in stack.placements):
        raise ValueError(f"experts sharded as {stack.placements}: only the expert dimension may be")
    _, offset = compute_local_shape_and_global_offset(stack.shape, stack.device_mesh, stack.placements)
    out = []
    for i, view in enumerate(stack.to_local()):
        setattr(view, _IN_PLACE, True)
        out.append((offset[0] + i, view))
    return out


def stack_experts(parts: dict[int, object]):
    """The [E, ...] stack of {expert index: tensor}; None for a sharded stack's local views (already in place,
    nothing to set) or for names only (no tensors)."""
    import torch

    values = [parts[e] for e in sorted(parts)]
    if values[0] is None or getattr(values[0], _IN_PLACE, False):
        return None
    return torch.stack(values)


def stack_all(experts: dict[str, dict[int, object]]) -> dict:
    """{stacked name: [E, ...] stack} of {stacked name: {expert index: tensor}}, leaving out a sharded stack's
    local views (filled in place already)."""
    out = {}
    for name, parts in experts.items():
        stack = stack_experts(parts)
        if stack is not None or next(iter(parts.values())) is None:
            out[name] = stack
    return out


def on_experts(fn, *stacks):
    """`fn` over stacked [E, ...] tensors whose other dimensions it rearranges (a checkpoint's fused or
    transposed layout): of DTensors (split over experts only) the local stacks, rewrapped the same way, so each
    rank reads or writes only its experts. None (names only) stays None."""
    from torch.distributed.tensor import DTensor

    if stacks[0] is None:
        return None
    if not isinstance(stacks[0], DTensor):
        return fn(*stacks)
    local = fn(*(s.to_local() for s in stacks)).contiguous()  # the wrapper's strides say contiguous
    shape = (stacks[0].shape[0], *local.shape[1:])
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return DTensor.from_local(local, stacks[0].device_mesh, stacks[0].placements, run_check=False, shape=shape,
                              stride=tuple(strides))


# Where transformers 5 holds a stacked expert weight in memory (what `peft` adapts with target_parameters): gate and
# up fused as `gate_up_proj` [E, 2 hidden, dim] (gate first), down as `down_proj` [E, dim, hidden], in this order
# in the experts module.
_FUSED = {"w1": ("gate_up_proj", 0, 0, 2), "w3": ("gate_up_proj", 0, 1, 2), "w2": ("down_proj", 1, 0, 1)}
_STACK = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")


def fused_expert_param(stack: str) -> tuple[str, int, int, int] | None:
    """HFAdapter.peft_param for decoders whose transformers model fuses experts as above, or None for a name that
    is no expert stack."""
    m = _STACK.fullmatch(stack)
    if m is None:
        return None
    param, position, block, blocks = _FUSED[m[2]]
    return f"model.layers.{m[1]}.mlp.experts.{param}", position, block, blocks
