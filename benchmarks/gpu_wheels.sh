#!/usr/bin/env bash
# The wheels benchmarks/gpu_suite.sh needs and the GPU machine lacks (its image: Python 3.12, torch 2.11, triton,
# transformers, tokenizers, safetensors, pyarrow, pandas, httpx, ...; see the device notes), downloaded here for
# Python 3.12 on x86-64 Linux, each pinned, without dependencies (every one that is missing is named below).
#   benchmarks/gpu_wheels.sh [DIR]     # default .whl (git-ignored: add /.whl/ to .git/info/exclude)
# Then carry DIR with the call; gpu_suite.sh installs DIR/*.whl into a target folder before it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
WHEELS=(
    # Tessera itself: its config writer, and torchao for Float8 (the image has neither)
    tomli-w==1.2.0 torchao==0.17.0
    # TorchTitan 0.2.2, the newest release that imports on torch 2.11 (docs/benchmarks.md), and what its METADATA's
    # Requires-Dist needs that the image lacks (tokenizers, tensorboard, einops, pillow, fsspec, pyarrow, pandas,
    # xxhash, huggingface-hub are there; Python 3.12 has tomllib): these versions imported it on torch 2.11
    torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
    datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
    # fla's Gated DeltaNet kernels (Qwen 3.5's `kernel = "fla"`): fla-core alone, pure Python + Triton; it needs
    # einops and triton (the image has both); flash-linear-attention adds only its layers and models (and wants
    # transformers >= 5.6.2), which Tessera does not import
    fla-core==0.6.0
)
mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" "${WHEELS[@]}"
ls -la "$DIR"
du -sh "$DIR"
