"""Images from a Flux checkpoint: `python -m tessera.models.flux.generate --job.dump_folder ./outputs/flux_debug
--generate.prompt "a big red circle in the middle"` writes a grid of 4 samples (noise seeds generate.seed ..
+3) to <dump_folder>/samples/generate-<seed>.png and prints its path. The encoders, resolution and sampling
settings are the checkpoint's run's (its config.toml), overridable with --flux.* flags.

Or from a diffusers folder (`--checkpoint.initial_load_in_hf --checkpoint.initial_load_path RELEASE/transformer`,
or a Tessera export): the settings are the flags', and the encoders by default the release the folder is part of
(its parent, when that holds text_encoder, tokenizer, vae...)."""

import dataclasses
import os
import sys

import numpy as np
import torch
from PIL import Image

from tessera.checkpoint.folder import read_saved_config
from tessera.checkpoint.hf import HFError
from tessera.config import ConfigError
from tessera.models.flux.checks import PATCH, RELEASE_PARTS, autoencoder_shape
from tessera.models.flux.data import FluxLoader
from tessera.models.flux.sample import grid, sample
from tessera.preflight import parse_args
from tessera.pretrained import checkpoint_folder, from_pretrained, is_hf, pick_device

N_IMAGES = 4


def _flux_settings(cfg, folder: str, argv: list[str], hf: bool):
    """cfg with the run's [flux] and training.seed (a diffusers folder: the release's encoders), except what the
    command line sets."""
    saved = read_saved_config(folder).get("flux", {})
    release = os.path.dirname(os.path.abspath(folder))
    if hf and all(os.path.isdir(os.path.join(release, part)) for part in RELEASE_PARTS):
        saved = {"encoders": release}
    given = {a[2:].partition("=")[0].split(".", 1)[1] for a in argv if a.startswith("--flux.")}
    fields = {f.name for f in dataclasses.fields(cfg.flux)}
    flux = dataclasses.replace(cfg.flux, **{k: v for k, v in saved.items() if k in fields and k not in given})
    return dataclasses.replace(cfg, flux=flux)


def _check_encoders(cfg, args, folder: str) -> None:
    try:
        latents, _ = autoencoder_shape(cfg.flux.encoders)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.in_channels != latents * PATCH * PATCH:
        raise ConfigError(f"flux.encoders: '{cfg.flux.encoders}' makes {latents * PATCH * PATCH} input channels "
                          f"(latent channels x 2 x 2), but the model in '{folder}' takes {args.in_channels}; pass the "
                          f"release folder it came with")


def main(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)
        g = cfg.generate
        source = cfg.checkpoint.initial_load_path or cfg.job.dump_folder
        hf = is_hf(source, cfg.checkpoint.initial_load_in_hf or None)
        folder = source if hf else checkpoint_folder(source)
        model, _ = from_pretrained(folder, pick_device(g.device), hf=hf)
        if type(model).__name__ != "Flux":
            raise ConfigError(f"checkpoint: '{folder}' holds no Flux model; use python -m tessera.generate")
        if not g.prompt:
            raise ConfigError("generate.prompt: empty; give the caption to draw")
        cfg = _flux_settings(cfg, folder, argv, hf)
        _check_encoders(cfg, model.args, folder)
        loader = FluxLoader(cfg, model.args, 0, 1, next(model.parameters()).device, "validation")
        f = cfg.flux
        images = np.concatenate([sample(model, loader, [g.prompt], f.sample_steps, f.guidance_scale, g.seed + i)
                                 for i in range(N_IMAGES)])
    except (ConfigError, HFError) as e:
        print(f"tessera.models.flux.generate: {e}", file=sys.stderr)
        return 2
    path = os.path.join(cfg.job.dump_folder, "samples", f"generate-{g.seed}.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    picture = grid(images, cols=N_IMAGES)
    Image.fromarray(picture).resize((picture.shape[1] * 4, picture.shape[0] * 4), Image.NEAREST).save(path)
    print(path)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main(sys.argv[1:]))
