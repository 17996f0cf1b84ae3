"""Precomputed encodings: run a family's frozen encoders over its data once, so that training reads their outputs
instead of encoding every step (a user at scale does this; Flux: the latents of image-caption pairs, its
ModelSpec.encode). Flux draws noise, timesteps and caption dropout per sample still, so a cached run equals an
encoding one.

    python -m tessera.cache --job.config_file configs/flux_debug.toml --flux.shapes_pairs 4096 \\
        --flux.latent_cache ./cache/shapes

writes <latent_cache>/<split>/<chunk>.pt (tessera.data.encoded) for the training split and, when validation is
enabled, the held-out one. Train with the same settings plus --flux.latent_cache."""

import os
import sys

import torch

from tessera import architecture
from tessera.config import ConfigError
from tessera.data.encoded import write_split
from tessera.schema import parse_args


def main(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)
        fam = architecture.check_model(cfg)
        encode = fam.spec().encode
        if encode is None:
            raise ConfigError(f"model.name: {cfg.model.name} has no frozen encoders whose outputs could be cached; "
                              f"it trains from its data as it is")
        args = architecture.resolve(architecture.request(fam, cfg), None, None)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            encoded = encode(cfg, args, device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for split, (n, batch) in encoded.splits.items():
            print(f"{split}: {n} examples in {write_split(encoded.folder, split, n, batch)} chunk(s) under "
                  f"{os.path.join(encoded.folder, split)}")
    except ConfigError as e:
        print(f"tessera.cache: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
