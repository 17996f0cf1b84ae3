"""Flux's data, batch and loss: image-caption pairs -> latents and text features (frozen encoders) -> the
rectified-flow objective. t ~ the configured distribution, x_t = (1 - t) x0 + t eps, target eps - x0 (MSE);
each text condition dropped (zeroed) with its probability, for classifier-free guidance.

Global sample i (rank r of D takes r, r + D, ... of each step) draws its pair, its noise, its t and its dropouts
from generators seeded by (seed, split, i): every layout and every resume sees the same samples, and the loader's
whole state is the global sample index. Held-out samples (split "validation") are noised to fixed timesteps."""

import logging

import torch
import torch.nn.functional as F

from tessera.models.contract import Encoded
from tessera.models.flux import shapes
from tessera.models.flux.encoders import build_conditioning, image_ids, patchify
from tessera.models.flux.latents import COLUMNS, LatentCache
from tessera.models.flux.options import FluxConfig
from tessera.models.flux.pairs import LISTERS, Pairs
from tessera.parallel import cp

log = logging.getLogger("tessera")


def sample_t(gen: torch.Generator, sampling: str, mean: float, std: float) -> float:
    if sampling == "uniform":
        return torch.rand((), generator=gen).item()
    return torch.sigmoid(mean + std * torch.randn((), generator=gen)).item()


def frozen_encoders(cfg: FluxConfig, args, device: torch.device, dp_mesh=None):
    """(text encoders, autoencoder) of `flux.encoders`: built once by whoever builds a run's loaders, and
    handed to each (the training and validation loaders share them)."""
    return build_conditioning(cfg.flux.encoders, cfg.flux.text_len, args, device, dp_mesh)


class FluxLoader:
    def __init__(self, cfg, args, dp_rank: int, dp_degree: int, device: torch.device, split: str = "train",
                 encoders=None, bad=None):
        f = cfg.flux
        self.cfg, self.args, self.split, self.device = cfg, args, split, device
        self.local_batch, self.dp_rank, self.dp_degree = cfg.training.local_batch_size, dp_rank, dp_degree
        self.text, self.autoencoder = encoders or frozen_encoders(cfg, args, device)
        side = f.resolution // self.autoencoder.scale
        self.img_ids, self.txt_ids = image_ids(side, side).to(device), torch.zeros(f.text_len, 3, device=device)
        self.val_t = [float(x) for x in f.val_timesteps]
        t = cfg.training
        self.source = (shapes.Shapes(t.seed, split, f.resolution, f.shapes_pairs) if t.dataset == "shapes"
                       else Pairs(t.dataset, t.dataset_path, split, t.seed, f.resolution, bad) if t.dataset in LISTERS
                       else None)  # sampling alone (generate) reads no data
        self.cache = LatentCache(f.latent_cache, split) if f.latent_cache else None
        self.sample_index = 0

    def pairs(self, indices: list[int]) -> tuple[torch.Tensor, list[str]]:
        """Images and captions of global samples `indices`."""
        return self.read([self.source.pair_id(i) for i in indices])

    def read(self, pair_ids: list[int]) -> tuple[torch.Tensor, list[str]]:
        drawn = [self.source.read(i) for i in pair_ids]
        return torch.stack([torch.from_numpy(img.copy()) for img, _ in drawn]), [c for _, c in drawn]

    def conditioned(self, indices: list[int]):
        """(x0, txt, pooled) of global samples `indices`: from the latent cache, else encoded now."""
        if self.cache is not None:
            return self.cache.get([self.source.pair_id(i) for i in indices], self.device)
        return self.encode(*self.pairs(indices))

    def encode(self, images: torch.Tensor, captions: list[str]):
        """(patchified latents [b, n, c*4], T5 features, pooled CLIP embedding)."""
        with torch.no_grad():
            latents = patchify(self.autoencoder.encode(images.to(self.device)))
            txt, pooled = self.text(captions)
        return latents, txt, pooled

    def next_batch(self) -> tuple[dict, torch.Tensor]:
        indices = [self.sample_index + self.dp_rank + self.dp_degree * j for j in range(self.local_batch)]
        self.sample_index += self.local_batch * self.dp_degree
        x0, txt, pooled = self.conditioned(indices)
        f, noise, ts = self.cfg.flux, [], []
        keep_txt, keep_pooled = (torch.ones(len(indices), device=self.device) for _ in range(2))
        for row, i in enumerate(indices):
            seed = shapes.rng(self.cfg.training.seed, self.split, i, stream=1).integers(2**62)
            gen = torch.Generator().manual_seed(int(seed))
            noise.append(torch.randn(x0.shape[1:], generator=gen))
            if self.split == "train":
                ts.append(sample_t(gen, f.timestep_sampling, f.logit_mean, f.logit_std))
                keep_txt[row] = float(torch.rand((), generator=gen).item() >= f.txt_dropout)
                keep_pooled[row] = float(torch.rand((), generator=gen).item() >= f.pooled_dropout)
            else:
                ts.append(self.val_t[i % len(self.val_t)])
        eps, t = torch.stack(noise).to(self.device, x0.dtype), torch.tensor(ts, device=self.device)
        x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * eps
        inputs = {"img": x_t, "txt": txt * keep_txt[:, None, None], "pooled": pooled * keep_pooled[:, None], "t": t,
                  "img_ids": self.img_ids, "txt_ids": self.txt_ids,
                  "guidance": torch.full_like(t, f.guidance) if self.args.guidance_embed else None}
        return inputs, eps - x0

    def rewind(self) -> None:
        self.sample_index = 0

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self.sample_index}

    def load_state_dict(self, state: dict) -> None:
        self.sample_index = int(state["sample_index"])


def encoded(cfg: FluxConfig, args, device: torch.device) -> Encoded:
    """The latents of the run's pairs, for its latent cache (ModelSpec.encode): both splits' loaders share the
    frozen encoders, loaded once."""
    f = cfg.flux
    if not f.latent_cache:
        raise ValueError("flux.latent_cache: empty; name the folder to write the cache to")
    if cfg.training.dataset == "shapes" and not f.shapes_pairs:
        raise ValueError("flux.shapes_pairs: 0 (endless shapes) cannot be cached; give the number of pairs")
    encoders = frozen_encoders(cfg, args, device)
    splits = {}
    for split in ("train", "validation") if cfg.validation.enable else ("train",):
        loader = FluxLoader(cfg, args, 0, 1, device, split, encoders)
        loader.cache = None  # writing it
        splits[split] = (len(loader.source), lambda ids, loader=loader: dict(zip(COLUMNS, loader.encode(
            *loader.read(ids)), strict=True)))
    return Encoded(folder=f.latent_cache, splits=splits)


def build_loaders(cfg: FluxConfig, world, args, splits: tuple[str, ...], bad=None) -> dict[str, FluxLoader]:
    """This rank's loader of each split; one set of frozen encoders (FSDP-sharded over data parallelism) for all."""
    if world.rank == 0:
        log.info(f"flux: an image is {cfg.training.seq_len} tokens ({cfg.flux.text_len} text + "
                 f"{cfg.training.seq_len - cfg.flux.text_len} image); tps counts them, samples_per_s counts images; "
                 f"FLOPs and MFU are the transformer's alone (text encoders and autoencoder excluded)")
    encoders = frozen_encoders(cfg, args, world.device, world.dp_mesh())
    return {split: FluxLoader(cfg, args, world.dp_rank, world.dims.dp, world.device, split, encoders, bad)
            for split in splits}


def flux_batch(run, loader) -> tuple[dict, torch.Tensor]:
    """The loader's batch; under context parallelism this rank's chunks of the text and of the image tokens
    (and of their ids and targets): attention is bidirectional, so any split works, and CP's is reused."""
    inputs, target = loader.next_batch()
    if run.world.dims.cp > 1:  # run: the run's tessera.models.contract.BatchView
        mesh = run.world.mesh["cp"]
        inputs = shard_inputs(inputs, mesh.get_local_rank(), mesh.size())
        target = cp.shard_sequence(target, mesh.get_local_rank(), mesh.size())
    return inputs, target


def shard_inputs(inputs: dict, rank: int, size: int) -> dict:
    sequences = {"img": 1, "txt": 1, "img_ids": 0, "txt_ids": 0}
    return {k: cp.shard_sequence(v, rank, size, dim=sequences[k]) if k in sequences else v for k, v in inputs.items()}


def flow_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target.float())
