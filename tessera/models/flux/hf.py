"""diffusers <-> Tessera for the Flux transformer (`FluxTransformer2DModel`, the `transformer/` folder of a
FLUX.1 release): Tessera's module names are diffusers', so the state dicts map one to one; config.json both ways."""

from tessera.models.flux.args import FluxArgs

CLASS_NAME = "FluxTransformer2DModel"
weights_name = "diffusion_pytorch_model"  # exports load with FluxTransformer2DModel.from_pretrained


def to_hf(state: dict) -> dict:
    return dict(state)


def from_hf(state: dict) -> dict:
    return dict(state)


def hf_config(args: FluxArgs, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    return {"_class_name": CLASS_NAME, "patch_size": 1, "in_channels": args.in_channels,
            "out_channels": None, "num_layers": args.n_double, "num_single_layers": args.n_single,
            "attention_head_dim": args.head_dim, "num_attention_heads": args.n_heads,
            "joint_attention_dim": args.context_dim, "pooled_projection_dim": args.pooled_dim,
            "guidance_embeds": args.guidance_embed, "axes_dims_rope": list(args.axes_dim)}


def args_from_hf_config(config: dict) -> FluxArgs:
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(f"_class_name is {config['_class_name']!r}, not {CLASS_NAME}: not a Flux transformer")
    for key, want in (("patch_size", 1), ("out_channels", None)):
        if config.get(key, want) not in (want, config["in_channels"] if key == "out_channels" else want):
            raise ValueError(f"{key} = {config[key]!r}: Tessera's flux computes {want} (patches are made outside)")
    return FluxArgs(n_heads=config["num_attention_heads"], head_dim=config["attention_head_dim"],
                    n_double=config["num_layers"], n_single=config["num_single_layers"],
                    in_channels=config["in_channels"], context_dim=config["joint_attention_dim"],
                    pooled_dim=config["pooled_projection_dim"], guidance_embed=bool(config.get("guidance_embeds")),
                    axes_dim=tuple(config.get("axes_dims_rope", (16, 56, 56))))
