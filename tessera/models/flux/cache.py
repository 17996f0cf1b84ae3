"""Precomputed latents: run the frozen encoders over a dataset once, so that training reads (x0, T5 features,
pooled CLIP embedding) per pair instead of encoding images and captions every step (a user at scale does this).
Noise, timesteps and caption dropout are still drawn per sample, so a cached run equals an encoding one.

    python -m tessera.models.flux.cache --job.config_file configs/flux_debug.toml --flux.shapes_pairs 4096 \\
        --flux.latent_cache ./cache/shapes

writes <latent_cache>/<split>/<chunk>.pt (CHUNK pairs each, by pair id) for the training split and, when validation
is enabled, the held-out one. Train with the same settings plus --flux.latent_cache."""

import os
import sys

import torch

from tessera.config import ConfigError
from tessera.models.flux.data import FluxLoader, frozen_encoders
from tessera.models.flux.latents import CHUNK
from tessera.preflight import parse_args


def write(loader, folder: str, n_pairs: int, batch: int = 64) -> int:
    """Encode pairs 0 .. n_pairs - 1 of the loader's split into `folder`; returns the chunks written."""
    out = os.path.join(folder, loader.split)
    os.makedirs(out, exist_ok=True)
    chunks = 0
    for start in range(0, n_pairs, CHUNK):
        ids = list(range(start, min(n_pairs, start + CHUNK)))
        parts = [loader.encode(*loader.read(ids[i:i + batch])) for i in range(0, len(ids), batch)]
        columns = {k: torch.cat([p[j] for p in parts]).cpu() for j, k in enumerate(("x0", "txt", "pooled"))}
        torch.save(columns, os.path.join(out, f"{start // CHUNK:06d}.pt"))
        chunks += 1
    return chunks


def main(argv: list[str]) -> int:
    from tessera import architecture
    try:
        cfg = parse_args(argv)
        if not cfg.flux.latent_cache:
            raise ConfigError("flux.latent_cache: empty; name the folder to write the cache to")
        if cfg.training.dataset == "shapes" and not cfg.flux.shapes_pairs:
            raise ConfigError("flux.shapes_pairs: 0 (endless shapes) cannot be cached; give the number of pairs")
        args = architecture.resolve(cfg, None, None)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        encoders = frozen_encoders(cfg, args, device)  # loaded once for both splits
        for split in ("train", "validation") if cfg.validation.enable else ("train",):
            loader = FluxLoader(cfg, args, 0, 1, device, split, encoders)
            loader.cache = None  # writing it
            n = len(loader.source)
            print(f"{split}: {n} pairs in {write(loader, cfg.flux.latent_cache, n)} chunk(s) under "
                  f"{os.path.join(cfg.flux.latent_cache, split)}")
    except ConfigError as e:
        print(f"tessera.models.flux.cache: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
