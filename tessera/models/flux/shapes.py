"""The built-in offline image-caption data: procedurally drawn shapes whose captions say what is drawn, so a
debug run's samples show whether the model learned to follow the text. Sample i of a split is a pure function of
(seed, split, i): any layout, any resume, the same pairs."""

import numpy as np
from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (235, 210, 40),
          "white": (240, 240, 240), "purple": (160, 60, 200)}
SHAPES = ("circle", "square", "triangle")
PLACES = {"on the left": (0.3, 0.5), "on the right": (0.7, 0.5), "at the top": (0.5, 0.3),
          "at the bottom": (0.5, 0.7), "in the middle": (0.5, 0.5)}
SPLITS = {"train": 0, "validation": 1}


def rng(seed: int, split: str, index: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS[split], index, stream])


def draw(seed: int, split: str, index: int, *, resolution: int) -> tuple[np.ndarray, str]:
    """(uint8 [resolution, resolution, 3], caption) of sample `index`."""
    r = rng(seed, split, index)
    color, shape = list(COLORS)[r.integers(len(COLORS))], SHAPES[r.integers(len(SHAPES))]
    place = list(PLACES)[r.integers(len(PLACES))]
    big = bool(r.integers(2))
    image = Image.new("RGB", (resolution, resolution), (20, 20, 30))
    pen = ImageDraw.Draw(image)
    cx, cy = (c * resolution for c in PLACES[place])
    half = resolution * (0.22 if big else 0.13)
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        pen.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        pen.rectangle(box, fill=COLORS[color])
    else:
        pen.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=COLORS[color])
    return np.asarray(image), f"a {'big' if big else 'small'} {color} {shape} {place}"


class Shapes:
    """The shapes as a source of pairs: endless (`n` = 0: sample i is pair i), or `n` pairs visited in turn (so
    that their latents can be cached)."""

    def __init__(self, seed: int, split: str, resolution: int, n: int = 0):
        self.seed, self.split, self.resolution, self.n = seed, split, resolution, n

    def __len__(self) -> int:
        return self.n

    def pair_id(self, index: int) -> int:
        return index % self.n if self.n else index

    def read(self, pair_id: int) -> tuple[np.ndarray, str]:
        return draw(self.seed, self.split, pair_id, resolution=self.resolution)

    def __call__(self, index: int) -> tuple[np.ndarray, str]:
        return self.read(self.pair_id(index))
