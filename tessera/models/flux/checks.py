"""Flux's config checks, torch-free: run before any process starts (`Family.check`)."""

import glob
import json
import os

from tessera.models.flux.args import FLAVORS
from tessera.models.flux.options import FluxConfig

DATASETS = ("shapes", "folder", "jsonl", "webdataset", "hub")
PATCH = 2  # latents are cut into 2x2 patches, one token each
TINY = {"tiny": (3, 1), "tiny_vae": (3, 2)}  # latent channels and downscale: pixels; encoders.TINY_VAE's
RELEASE_PARTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae")


def autoencoder_shape(encoders: str) -> tuple[int, int]:
    """(latent channels, downscale) of `flux.encoders`."""
    if encoders in TINY:
        return TINY[encoders]
    missing = [p for p in RELEASE_PARTS if not os.path.isdir(os.path.join(encoders, p))]
    if missing:
        raise ValueError(f"flux.encoders: '{encoders}' is neither tiny, tiny_vae nor a FLUX.1 release folder (no "
                         f"{', '.join(missing)}); fetch one with scripts/download_hf_assets.py")
    path = os.path.join(encoders, "vae", "config.json")
    try:
        with open(path) as fh:
            config = json.load(fh)
        return config["latent_channels"], 2 ** (len(config["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"flux.encoders: {path} is not a diffusers AutoencoderKL config ({e}); download it "
                         f"again") from None


def release_options(folder: str) -> dict:
    """The encoders of a diffusers transformer/ folder: the release it is part of (its parent), when that holds
    text_encoder, tokenizer, vae... (ModelSpec.draw_options)."""
    release = os.path.dirname(os.path.abspath(folder))
    return {"encoders": release} if all(os.path.isdir(os.path.join(release, p)) for p in RELEASE_PARTS) else {}


def _hf_args(path: str):
    from tessera.models import hf_args

    try:
        return hf_args("flux", path)
    except ValueError as e:
        raise ValueError(f"checkpoint.initial_load_path: {e}") from None


def image_tokens(resolution: int, scale: int) -> int:
    return (resolution // (scale * PATCH)) ** 2


def check(cfg: FluxConfig, resolved=None, dims=None) -> None:
    """The [flux] section and what Flux needs of the rest (its data in place of the text data's checks); the
    architecture is the flavor's or the imported folder's (`resolved`, the launcher's, is not needed)."""
    f, t, m = cfg.flux, cfg.training, cfg.model
    from_hf = cfg.checkpoint.initial_load_in_hf and cfg.checkpoint.initial_load_path
    if not m.flavor and not from_hf:
        raise ValueError(f"model.flavor: empty; choose one of {', '.join(FLAVORS)} (or import a diffusers "
                         f"transformer/ folder with checkpoint.initial_load_in_hf)")
    args = FLAVORS[m.flavor] if m.flavor else _hf_args(cfg.checkpoint.initial_load_path)
    if t.dataset not in DATASETS:
        raise ValueError(f"training.dataset: '{t.dataset}' is not an image-caption dataset Tessera's flux reads; "
                         f"use shapes (built in), folder, jsonl, webdataset or hub (with training.dataset_path)")
    if t.dataset == "shapes" and t.dataset_path:
        raise ValueError(f"training.dataset_path: '{t.dataset_path}' is given, but training.dataset = 'shapes' is "
                         f"drawn, not read; leave it empty, or set training.dataset to folder, jsonl or webdataset")
    if t.dataset == "hub" and not t.dataset_path:
        raise ValueError("training.dataset_path: empty; name the Hugging Face dataset (ORG/NAME) for dataset = hub")
    if t.dataset not in ("shapes", "hub") and not (os.path.exists(t.dataset_path) or glob.glob(t.dataset_path or "\0")):
        raise ValueError(f"training.dataset_path: nothing at '{t.dataset_path}' for training.dataset = "
                         f"'{t.dataset}'; name the {'folder' if t.dataset == 'folder' else 'file, folder or glob'}")
    if f.latent_cache and t.dataset == "shapes" and not f.shapes_pairs:
        raise ValueError("flux.latent_cache: endless shapes (flux.shapes_pairs = 0) cannot be cached; set "
                         "flux.shapes_pairs to the number of pairs the cache holds")
    if f.latent_cache and not os.path.isfile(os.path.join(f.latent_cache, "train", "000000.pt")):
        raise ValueError(f"flux.latent_cache: no cache in '{f.latent_cache}'; write it first with python -m "
                         f"tessera.cache (same flags), or leave it empty to encode on the fly")
    if m.converters:
        raise ValueError("model.converters: Float8/MX are not wired into flux yet; remove them")
    if m.attn_mask_type != "causal":
        raise ValueError(f"model.attn_mask_type: '{m.attn_mask_type}' masks packed documents of tokens; flux attends "
                         f"over one image and its caption in both directions; remove it")
    latents, scale = autoencoder_shape(f.encoders)
    if args.in_channels != latents * PATCH * PATCH:
        raise ValueError(f"model.flavor: '{m.flavor}' takes {args.in_channels} input channels, but flux.encoders = "
                         f"'{f.encoders}' makes {latents * PATCH * PATCH} (latent channels x 2 x 2); pair flux-debug "
                         f"with tiny or tiny_vae, the released flavors with a release's folder")
    if f.resolution % (scale * PATCH):
        raise ValueError(f"flux.resolution: {f.resolution} is not a multiple of {scale * PATCH} (the "
                         f"autoencoder's downscale x the 2x2 patch); pick one that is")
    n_img = image_tokens(f.resolution, scale)
    if t.seq_len != f.text_len + n_img:
        raise ValueError(f"training.seq_len: {t.seq_len}, but flux's joint sequence is flux.text_len {f.text_len} + "
                         f"{n_img} image tokens at resolution {f.resolution} = {f.text_len + n_img}; set "
                         f"--training.seq_len {f.text_len + n_img}")
    cp = cfg.parallelism.context_parallel_degree
    for what, n in (("flux.text_len", f.text_len), ("image tokens", n_img)):
        if n % (2 * cp):
            raise ValueError(f"parallelism.context_parallel_degree: {what} ({n}) must be divisible by 2 x {cp}; "
                             f"each CP rank holds two equal chunks of the text and of the image tokens")
    try:
        ts = [float(x) for x in f.val_timesteps]
    except ValueError:
        raise ValueError(f"flux.val_timesteps: {f.val_timesteps} are not numbers; e.g. 0.25,0.5,0.75") from None
    if not ts or not all(0.0 <= x <= 1.0 for x in ts):
        raise ValueError(f"flux.val_timesteps: {f.val_timesteps}: give one or more t in [0, 1]")
