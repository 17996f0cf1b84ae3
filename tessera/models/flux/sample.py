"""Sampling: Euler steps of the flow from noise (t = 1) to an image (t = 0), with classifier-free guidance (or,
for guidance-embedding flavors, the scale fed to the model), decoded by the autoencoder and tiled into a PNG
grid. `draw` is Flux's ModelSpec.draw: images of a caption from a loaded model (python -m tessera.generate). During
training every `flux.sample_freq` steps (and at the last) a few fixed prompts are drawn from fixed
noise, so the grids of one run differ only by what the model learned; they go to <dump_folder>/samples/ and to
TensorBoard."""

import logging
import os

import numpy as np
import torch
import torch.distributed as dist

from tessera.images import grid, save_png
from tessera.models.contract import RunView
from tessera.models.flux.checks import PATCH, autoencoder_shape
from tessera.models.flux.data import FluxLoader, shard_inputs
from tessera.models.flux.encoders import unpatchify
from tessera.models.flux.options import FluxConfig
from tessera.parallel import cp

log = logging.getLogger("tessera")


def _gather_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """The inverse of cp.shard_sequence along dim 1, over the CP group."""
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    half, ordered = x.shape[1] // 2, [None] * (2 * size)
    for rank, part in enumerate(parts):
        head, tail = cp.chunk_ids(rank, size)
        ordered[head], ordered[tail] = part[:, :half], part[:, half:]
    return torch.cat(ordered, dim=1)


def velocity(model, inputs: dict, cp_mesh=None) -> torch.Tensor:
    if cp_mesh is None:
        return model(**inputs)
    out = model(**shard_inputs(inputs, cp_mesh.get_local_rank(), cp_mesh.size()))
    return _gather_sequence(out, cp_mesh.get_group(), cp_mesh.size())


@torch.no_grad()
def sample(model, loader, prompts: list[str], steps: int, scale: float, seed: int, cp_mesh=None) -> np.ndarray:
    """uint8 [n, h, w, 3] images of `prompts`, from noise seeded by `seed` (the same on every rank)."""
    device, side = loader.device, loader.cfg.flux.resolution // loader.autoencoder.scale
    n = len(prompts)
    txt, pooled = loader.text(prompts)
    x = torch.randn(n, (side // 2) ** 2, loader.autoencoder.channels * 4,
                    generator=torch.Generator().manual_seed(seed)).to(device)
    guided = not loader.args.guidance_embed and scale != 1.0  # CFG: the unconditional pass sees dropped text
    ts = torch.linspace(1.0, 0.0, steps + 1).tolist()
    for t, t_next in zip(ts[:-1], ts[1:], strict=True):
        base = {"img_ids": loader.img_ids, "txt_ids": loader.txt_ids, "t": torch.full((n,), t, device=device),
                "guidance": torch.full((n,), scale, device=device) if loader.args.guidance_embed else None}
        v = velocity(model, {**base, "img": x, "txt": txt, "pooled": pooled}, cp_mesh)
        if guided:
            v_null = velocity(model, {**base, "img": x, "txt": torch.zeros_like(txt),
                                      "pooled": torch.zeros_like(pooled)}, cp_mesh)
            v = v_null + scale * (v - v_null)
        x = x + (t_next - t) * v
    return loader.autoencoder.decode(unpatchify(x, side, side)).cpu().numpy()


def _check_encoders(cfg: FluxConfig, args, folder: str) -> None:
    latents, _ = autoencoder_shape(cfg.flux.encoders)
    if args.in_channels != latents * PATCH * PATCH:
        raise ValueError(f"flux.encoders: '{cfg.flux.encoders}' makes {latents * PATCH * PATCH} input channels "
                         f"(latent channels x 2 x 2), but the model in '{folder}' takes {args.in_channels}; pass the "
                         f"release folder it came with")


def draw(model, cfg: FluxConfig, folder: str, prompt: str, seeds: list[int]) -> np.ndarray:
    """uint8 [len(seeds), h, w, 3] images of `prompt` from the model loaded from `folder`, one per noise seed, with
    cfg.flux's encoders, resolution and sampling settings."""
    _check_encoders(cfg, model.args, folder)
    loader = FluxLoader(cfg, model.args, 0, 1, next(model.parameters()).device, "validation")
    f = cfg.flux
    return np.concatenate([sample(model, loader, [prompt], f.sample_steps, f.guidance_scale, seed) for seed in seeds])


def evaluate(tr: RunView, last: bool) -> bool:
    """Sample grids of the training run: all ranks step the model (FSDP and CP need them all), rank 0 writes."""
    f = tr.cfg.flux
    if not f.sample_freq or not (tr.step % f.sample_freq == 0 or last):
        return False
    was_training = tr.model.training
    tr.model.eval()
    with tr.autocast:
        images = sample(tr.model, tr.loader, list(f.sample_prompts), f.sample_steps, f.guidance_scale, f.sample_seed,
                        tr.world.mesh["cp"] if tr.world.dims.cp > 1 else None)
    tr.model.train(was_training)
    if tr.world.rank != 0:
        return True
    picture = grid(images, cols=min(4, len(images)))
    path = os.path.join(tr.cfg.job.dump_folder, "samples", f"step-{tr.step:06d}.png")
    save_png(picture, path)
    tr.image("samples", picture, tr.step)
    log.info(f"step {tr.step}: samples of {len(images)} prompts in {path}")
    return True
