"""Black Forest Labs' names (the single-file `flux1-schnell.safetensors` / `flux1-dev.safetensors` of a release) <->
Tessera's (diffusers') for the Flux transformer: q, k, v fused per stream (`img_attn.qkv`, `txt_attn.qkv`), the
single blocks' q, k, v and MLP input fused (`linear1`) and their outputs (`linear2`), the final adaLN in (shift,
scale) order where diffusers keeps (scale, shift). Both ways split and concatenate along dim 0 only.

Run by `python -m tessera.convert MODE SRC DST --model.name flux` (the family's `ModelSpec.convert`):

    bfl-to-diffusers flux1-schnell.safetensors OUT   # then checkpoint.initial_load_path
    diffusers-to-bfl EXPORT_FOLDER OUT/flux.safetensors     # an export in BFL's names
    bfl-vae-to-diffusers ae.safetensors OUT/vae       # with the Flux VAE's config.json
    diffusers-vae-to-bfl VAE_FOLDER OUT/ae.safetensors
"""

import json
import os
import re
from pathlib import Path

import torch

_ROOT = {"time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
         "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
         "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
         "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
         "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
         "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
         "txt_in": "context_embedder", "img_in": "x_embedder", "final_layer.linear": "proj_out"}
_DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear", "img_attn.proj": "attn.to_out.0",
           "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
           "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
           "img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
           "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
           "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight"}
_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out", "norm.query_norm.scale": "attn.norm_q.weight",
           "norm.key_norm.scale": "attn.norm_k.weight"}
_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
          "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.(.+)")
_OURS_STACK = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _rename(name: str, table: dict) -> str | None:
    for theirs, ours in table.items():
        if name == theirs or name.startswith(theirs + "."):
            return ours + name[len(theirs):]
    return None


def from_bfl(state: dict) -> dict:
    """BFL names -> ours. Split sizes: the hidden size is img_in's output rows."""
    state = {k.removeprefix("model.diffusion_model."): v for k, v in state.items()}
    dim, out = state["img_in.weight"].shape[0], {}
    for name, value in state.items():
        if name.startswith("final_layer.adaLN_modulation.1."):
            out["norm_out.linear." + name.rsplit(".", 1)[1]] = _swap_halves(value)
        elif m := _BLOCK.fullmatch(name):
            stack, i, rest = m[1], m[2], m[3]
            prefix = f"{_OURS_STACK[stack]}.{i}."
            fused, _, kind = rest.rpartition(".")
            if fused in _FUSED:
                sizes = [dim] * 3 + ([value.shape[0] - 3 * dim] if fused == "linear1" else [])
                for part, piece in zip(_FUSED[fused], value.split(sizes, dim=0), strict=True):
                    out[f"{prefix}{part}.{kind}"] = piece
            else:
                renamed = _rename(rest, _DOUBLE if stack == "double_blocks" else _SINGLE)
                if renamed is None:
                    raise KeyError(f"unknown BFL tensor '{name}'")
                out[prefix + renamed] = value
        elif (renamed := _rename(name, _ROOT)) is not None:
            out[renamed] = value
        else:
            raise KeyError(f"unknown BFL tensor '{name}'")
    return out


def to_bfl(state: dict) -> dict:
    """Ours -> BFL names (fused tensors concatenated)."""
    inverse_root = {v: k for k, v in _ROOT.items()}
    out = {}
    for name, value in state.items():
        if name.startswith("norm_out.linear."):
            out["final_layer.adaLN_modulation.1." + name.rsplit(".", 1)[1]] = _swap_halves(value)
            continue
        renamed = _rename(name, inverse_root)
        if renamed is not None:
            out[renamed] = value
    for stack, ours_stack in _OURS_STACK.items():
        table = {v: k for k, v in (_DOUBLE if stack == "double_blocks" else _SINGLE).items()}
        blocks = sorted({int(n.split(".")[1]) for n in state if n.startswith(ours_stack + ".")})
        for i in blocks:
            prefix = f"{ours_stack}.{i}."
            for name in [n for n in state if n.startswith(prefix)]:
                if (renamed := _rename(name[len(prefix):], table)) is not None:
                    out[f"{stack}.{i}.{renamed}"] = state[name]
            for fused, parts in _FUSED.items():
                if (stack == "single_blocks") != (fused == "linear1"):
                    continue
                for kind in ("weight", "bias"):
                    out[f"{stack}.{i}.{fused}.{kind}"] = torch.cat([state[f"{prefix}{p}.{kind}"] for p in parts])
    return out


def config_of(state: dict, axes_dim=(16, 56, 56)) -> dict:
    """The diffusers config.json of a BFL state dict (RoPE axes are not in the weights: the release's)."""
    head_dim = state["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
    dim = state["img_in.weight"].shape[0]
    count = lambda stack: len({k.split(".")[1] for k in state if k.startswith(stack + ".")})  # noqa: E731
    return {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": state["img_in.weight"].shape[1],
            "num_layers": count("double_blocks"), "num_single_layers": count("single_blocks"),
            "attention_head_dim": head_dim, "num_attention_heads": dim // head_dim,
            "joint_attention_dim": state["txt_in.weight"].shape[1],
            "pooled_projection_dim": state["vector_in.in_layer.weight"].shape[1],
            "guidance_embeds": "guidance_in.in_layer.weight" in state, "axes_dims_rope": list(axes_dim)}


def write_diffusers(src: Path, dst: Path) -> None:
    """BFL's single file -> a diffusers transformer folder (weights and config.json)."""
    from safetensors.torch import load_file, save_file

    state = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(src).items()}
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in from_bfl(state).items()}, dst / "diffusion_pytorch_model.safetensors")
    (dst / "config.json").write_text(json.dumps(config_of(state), indent=2))


def write_bfl(src: Path, dst: Path) -> None:
    """A diffusers transformer folder (an export) -> BFL's single file."""
    from safetensors.torch import load_file, save_file

    state = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            state.update(load_file(src / name))
    save_file({k: v.contiguous() for k, v in to_bfl(state).items()}, dst)


def write_vae_diffusers(src: Path, dst: Path) -> None:
    """BFL's ae.safetensors -> a diffusers AutoencoderKL folder; the file carries no config: the FLUX.1 VAE's
    (VAEArgs' defaults)."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from tessera.models.flux.vae import VAEArgs

    args = VAEArgs()
    levels = len(args.block_out_channels)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in vae_from_bfl(load_file(src), levels).items()},
              dst / "diffusion_pytorch_model.safetensors")
    (dst / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", **dataclasses.asdict(args),
                                                 "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * levels,
                                                 "up_block_types": ["UpDecoderBlock2D"] * levels}, indent=2))


def write_vae_bfl(src: Path, dst: Path) -> None:
    """A diffusers AutoencoderKL folder -> BFL's ae.safetensors."""
    from safetensors.torch import load_file, save_file

    levels = len(json.loads((src / "config.json").read_text())["block_out_channels"])
    state = load_file(src / "diffusion_pytorch_model.safetensors")
    save_file({k: v.contiguous() for k, v in vae_to_bfl(state, levels).items()}, dst)


CONVERSIONS = {"bfl-to-diffusers": ("folder", write_diffusers), "diffusers-to-bfl": ("file", write_bfl),
               "bfl-vae-to-diffusers": ("folder", write_vae_diffusers), "diffusers-vae-to-bfl": ("file", write_vae_bfl)}


# The autoencoder: BFL's ae.safetensors keeps the original latent-diffusion names (encoder.down.0.block.0, mid.attn_1
# with 1x1-conv q/k/v, decoder levels numbered from the lowest resolution up).
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_RULES = [(r"(en|de)coder\.conv_norm_out\.", r"\1coder.norm_out."),
              (r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block."),
              (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
              (r"mid_block\.resnets\.0\.", "mid.block_1."), (r"mid_block\.resnets\.1\.", "mid.block_2."),
              (r"\.conv_shortcut\.", ".nin_shortcut.")]


def vae_to_bfl(state: dict, levels: int) -> dict:
    """Ours (diffusers') -> BFL's ae.safetensors names; `levels` = len(block_out_channels)."""
    out = {}
    for name, value in state.items():
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.",
                     lambda m: f"decoder.up.{levels - 1 - int(m[1])}.{'block' if m[2] == 'resnets' else 'upsample'}.",
                     name)
        for pattern, repl in _VAE_RULES:
            new = re.sub(pattern, repl, new)
        if m := re.fullmatch(r"(.*)mid_block\.attentions\.0\.(.+)\.(weight|bias)", new):
            new = f"{m[1]}mid.attn_1.{_VAE_ATTN[m[2]]}.{m[3]}"
            if m[3] == "weight" and m[2] != "group_norm":
                value = value[:, :, None, None]  # 1x1 convolutions there
        out[new] = value
    return out


def vae_from_bfl(state: dict, levels: int) -> dict:
    """BFL's ae.safetensors names -> ours (the inverse of vae_to_bfl)."""
    inverse = {v: k for k, v in _VAE_ATTN.items()}
    out = {}
    for name, value in state.items():
        new = re.sub(r"decoder\.up\.(\d+)\.(block|upsample)\.",
                     lambda m: f"decoder.up_blocks.{levels - 1 - int(m[1])}."
                               f"{'resnets' if m[2] == 'block' else 'upsamplers.0'}.", name)
        new = re.sub(r"encoder\.down\.(\d+)\.block\.", r"encoder.down_blocks.\1.resnets.", new)
        new = re.sub(r"encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0.", new)
        new = re.sub(r"(en|de)coder\.norm_out\.", r"\1coder.conv_norm_out.", new)
        new = new.replace("mid.block_1.", "mid_block.resnets.0.").replace("mid.block_2.", "mid_block.resnets.1.")
        new = new.replace(".nin_shortcut.", ".conv_shortcut.")
        if m := re.fullmatch(r"(.*)mid\.attn_1\.(.+)\.(weight|bias)", new):
            new = f"{m[1]}mid_block.attentions.0.{inverse[m[2]]}.{m[3]}"
            if value.dim() == 4:
                value = value[:, :, 0, 0]
        out[new] = value
    return out
