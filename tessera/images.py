"""Pictures of a batch of images: tiled into one grid and written as a PNG (a family's samples during training, and
what `python -m tessera.generate` draws)."""

import os

import numpy as np
from PIL import Image


def grid(images: np.ndarray, cols: int = 4) -> np.ndarray:
    """uint8 images [n, h, w, c] tiled `cols` a row, 2-pixel black borders."""
    n, h, w, c = images.shape
    rows = -(-n // cols)
    out = np.zeros((rows * (h + 2) + 2, cols * (w + 2) + 2, c), dtype=np.uint8)
    for i, img in enumerate(images):
        r, col = divmod(i, cols)
        out[2 + r * (h + 2):2 + r * (h + 2) + h, 2 + col * (w + 2):2 + col * (w + 2) + w] = img
    return out


def save_png(picture: np.ndarray, path: str) -> None:
    """`picture` at 4x its size (nearest: pixels stay sharp), at `path` (its folder made)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(picture).resize((picture.shape[1] * 4, picture.shape[0] * 4), Image.NEAREST).save(path)
