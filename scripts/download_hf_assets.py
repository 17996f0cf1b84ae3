"""Download a Hugging Face model's tokenizer, config and/or weights to assets/hf/<NAME>/.

    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.2-1B --assets tokenizer config safetensors

Gated repos need a token: --hf_token or the HF_TOKEN environment variable (never printed or saved).
"""

import argparse
import os
import sys
from pathlib import Path

ASSETS = {
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"],
    "config": ["config.json", "generation_config.json"],
    "safetensors": ["*.safetensors", "model.safetensors.index.json"],
    # A FLUX.1 release (diffusers layout): the frozen encoders and VAE (flux.encoders), the transformer to import.
    "flux_encoders": ["model_index.json", "text_encoder/*", "text_encoder_2/*", "tokenizer/*", "tokenizer_2/*",
                      "vae/*"],
    "flux_transformer": ["transformer/*"],
}


def patterns(assets: list[str]) -> list[str]:
    """File patterns (snapshot_download's allow_patterns) for the asset kinds, in order, without repeats."""
    unknown = [a for a in assets if a not in ASSETS]
    if unknown:
        raise ValueError(f"unknown asset '{unknown[0]}'; one of {', '.join(ASSETS)}")
    return list(dict.fromkeys(p for a in assets for p in ASSETS[a]))


def _why(e: Exception, repo_id: str) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return f"'{repo_id}' is gated: accept its license on huggingface.co and pass --hf_token or set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return (f"repository '{repo_id}' not found, or private and the token lacks access "
                f"(pass --hf_token or set HF_TOKEN)")
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return f"cannot reach the Hugging Face Hub for '{repo_id}' (offline, or HF_HUB_OFFLINE=1) and no cached copy"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status == 401:
        return f"not authorized for '{repo_id}': pass a valid --hf_token or set HF_TOKEN"
    return f"download of '{repo_id}' failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo_id", required=True, help="ORG/NAME on the Hugging Face Hub")
    p.add_argument("--assets", nargs="+", required=True, choices=ASSETS, help="what to download")
    p.add_argument("--hf_token", default=None, help="access token (default: $HF_TOKEN)")
    p.add_argument("--local_dir", default="assets/hf", help="files go to LOCAL_DIR/<NAME>/")
    opts = p.parse_args(argv)
    if opts.repo_id.count("/") != 1 or not all(opts.repo_id.split("/")):
        p.error(f"--repo_id must look like ORG/NAME, got '{opts.repo_id}'")
    target = Path(opts.local_dir) / opts.repo_id.split("/")[1]

    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id=opts.repo_id, allow_patterns=patterns(opts.assets), local_dir=target,
                          token=opts.hf_token or os.environ.get("HF_TOKEN") or None)
    except Exception as e:  # noqa: BLE001 - any failure becomes one line, never a traceback with the token
        print(f"download_hf_assets: error: {_why(e, opts.repo_id)}", file=sys.stderr)
        return 1
    files = sorted(str(f.relative_to(target)) for f in target.rglob("*") if f.is_file() and ".cache" not in f.parts)
    if not files:
        print(f"download_hf_assets: error: '{opts.repo_id}' has no files matching {patterns(opts.assets)}",
              file=sys.stderr)
        return 1
    print(f"{opts.repo_id} -> {target}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
