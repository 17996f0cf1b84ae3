"""Flux's own options: the [flux] section of a config (Family.options)."""

from dataclasses import dataclass

from tessera.config.sections import JobConfig, opt


@dataclass
class FluxOptions:
    """model.name = flux: its data, encoders and objective (tessera/models/flux/)."""
    resolution: int = opt(16, "image side in pixels after resize and center crop", min=4)
    text_len: int = opt(48, "text tokens per caption (T5's sequence, padded or cut); training.seq_len must be "
                        "text_len + the image tokens", min=1)
    encoders: str = opt("tiny", "frozen text encoders and autoencoder: tiny = random-init T5 and CLIP from in-repo "
                        "configs with a pixel-space autoencoder (offline, CPU); tiny_vae = the same with a random-init "
                        "Flux VAE; else the folder of a FLUX.1 release (text_encoder, text_encoder_2, tokenizer, "
                        "tokenizer_2, vae)")
    timestep_sampling: str = opt("logit_normal", "distribution of t in [0, 1]", choices=("uniform", "logit_normal"))
    logit_mean: float = opt(0.0, "logit_normal: mean of logit(t)")
    logit_std: float = opt(1.0, "logit_normal: standard deviation of logit(t)", min=0.0)
    txt_dropout: float = opt(0.1, "probability of dropping a caption's T5 features (classifier-free guidance)",
                             min=0.0, max=1.0)
    pooled_dropout: float = opt(0.1, "probability of dropping a caption's pooled CLIP embedding", min=0.0, max=1.0)
    guidance: float = opt(3.5, "guidance scale fed to guidance-embedding flavors (flux-dev) in training", min=0.0)
    val_timesteps: list[str] = opt(["0.25", "0.5", "0.75"], "validation: the fixed t each held-out sample is "
                                   "noised to, in turn")
    latent_cache: str = opt("", "folder of precomputed latents and text features (python -m tessera.cache "
                            "writes it), read instead of running the encoders; empty = encode on the fly")
    shapes_pairs: int = opt(0, "dataset = shapes: that many pairs, repeated (needed to cache them); 0 = endless", min=0)
    sample_freq: int = opt(0, "write a PNG grid of sample_prompts every N steps (and at the last); 0 = never", min=0)
    sample_prompts: list[str] = opt(["a big red circle in the middle", "a big blue square on the left",
                                     "a small green triangle at the top", "a big yellow circle on the right",
                                     "a small white square at the bottom", "a big purple triangle in the middle",
                                     "a small red square on the right", "a big green circle on the left"],
                                    "captions of the sample grid, one image each")
    sample_steps: int = opt(20, "Euler steps from noise to image", min=1)
    guidance_scale: float = opt(4.0, "classifier-free guidance scale of samples (guidance-embedding flavors: fed to "
                                "the model instead); 1 = none", min=0.0)
    sample_seed: int = opt(0, "seed of the samples' noise", min=0)


class FluxConfig(JobConfig):
    """The whole config as Flux's code reads it (a type for readers and checkers, never built: the schema,
    tessera.schema, mounts FluxOptions as the `flux` section of the one JobConfig)."""
    flux: FluxOptions
