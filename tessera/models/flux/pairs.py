"""Image-caption pairs from local data, addressed by a global sample index (so the position is one number, ranks
take disjoint samples and a resume continues exactly):

- `folder`: image files (jpg, jpeg, png, webp, bmp) under `training.dataset_path`, each with a caption file of the
  same name and `.txt`;
- `jsonl`: a file of {"image": path (relative to the file), "caption": text} lines;
- `webdataset`: tar shards (a file, a folder of .tar, or a glob) as cc12m ships them: members `<key>.jpg` (or png,
  webp) and `<key>.txt` (or `<key>.json` with a "caption");
- `hub`: a Hugging Face dataset (`ORG/NAME`, or a local folder `datasets.load_dataset` reads) with an image column
  and a caption column (caption, text, txt or prompt), its train split downloaded once (random access).

The listing is read once per process, sorted, the same on every rank. Every 100th pair is held out (the
validation split), the rest is the training split; epoch e visits its pairs in a permutation seeded by (seed, e).
Images are resized (shorter side) to the resolution and center-cropped."""

import glob
import json
import os
import tarfile
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image

from tessera.data.records import DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
HOLD_OUT = 100  # every HOLD_OUT-th pair is validation's


def _folder(root: str, bad) -> list[tuple]:
    pairs = []
    for path in sorted(Path(root).rglob("*")):
        if path.suffix.lower() in IMAGE_EXTS:
            caption = path.with_suffix(".txt")
            if caption.is_file():
                pairs.append(("file", str(path), caption.read_text(encoding="utf-8-sig", errors="replace").strip()))
            elif bad is not None:
                bad.skip(path, "", "no caption file beside it (same name, .txt)")
    return pairs


def _jsonl(path: str, bad) -> list[tuple]:
    pairs, base = [], os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8-sig") as fh:  # "-sig": a byte-order mark before the first line is no text
        for n, line in enumerate(fh, start=1):
            try:
                record = json.loads(line)
                pairs.append(("file", os.path.join(base, record["image"]), str(record["caption"])))
            except (ValueError, KeyError, TypeError) as e:
                if bad is not None:
                    bad.skip(Path(path), f"line {n}", f"not a JSON object with image and caption ({e})")
    return pairs


def _shards(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "*.tar")))
    return sorted(glob.glob(path))


def _webdataset(path: str, bad) -> list[tuple]:
    pairs = []
    for shard in _shards(path):
        with tarfile.open(shard) as tar:
            members: dict[str, dict[str, tarfile.TarInfo]] = {}
            for m in tar.getmembers():
                key, _, ext = m.name.rpartition(".")
                members.setdefault(key, {})[ext.lower()] = m
            for key in sorted(members):
                found = members[key]
                image = next((found[e[1:]] for e in IMAGE_EXTS if e[1:] in found), None)
                caption = found.get("txt") or found.get("json")
                if image is None or caption is None:
                    if bad is not None:
                        bad.skip(Path(shard), key, "no image or no caption (.txt / .json) for this key")
                    continue
                pairs.append(("tar", shard, image.name, caption.name))
    return pairs


CAPTION_COLUMNS = ("caption", "text", "txt", "prompt")


def hub_dataset(path: str) -> tuple:
    """(the dataset, its image column, its caption column) of a Hub name or a local copy."""
    import datasets

    try:
        ds = datasets.load_dataset(path, split="train")
    except Exception as e:  # offline, a missing repo, a bad folder: all surface here
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise DataError(f"training.dataset_path: cannot load '{path}' with datasets.load_dataset ({why}); check "
                        f"the name, the network or HF_TOKEN, or use a local copy") from None
    image = next((c for c, f in ds.features.items() if isinstance(f, datasets.Image)), None)
    caption = next((c for c in CAPTION_COLUMNS if c in ds.features), None)
    if image is None or caption is None:
        raise DataError(f"training.dataset_path: '{path}' has no image column or no caption column (one of "
                        f"{', '.join(CAPTION_COLUMNS)}); its columns are {', '.join(ds.features)}")
    return ds, image, caption


def _hub_entries(path: str, hub: tuple) -> list[tuple]:
    return [("hub", path, i) for i in range(len(hub[0]))]


LISTERS = {"folder": _folder, "jsonl": _jsonl, "webdataset": _webdataset,
           "hub": lambda path, bad: _hub_entries(path, hub_dataset(path))}


def listing(kind: str, path: str, split: str, bad=None, hub: tuple | None = None) -> list[tuple]:
    """The pairs of `split` (every HOLD_OUT-th is validation's); `hub`: the dataset hub_dataset loaded, if any."""
    pairs = _hub_entries(path, hub) if hub is not None else LISTERS[kind](path, bad)
    if split == "validation":
        return pairs[::HOLD_OUT]
    return [p for i, p in enumerate(pairs) if i % HOLD_OUT]


def _tar_read(shard: str, name: str) -> bytes:
    with tarfile.open(shard) as tar:
        return tar.extractfile(name).read()


def load(entry: tuple, resolution: int, hub: tuple | None = None) -> tuple[np.ndarray, str]:
    """(uint8 [resolution, resolution, 3], caption) of a listed pair (`hub`: its dataset, for a Hub pair)."""
    try:
        if entry[0] == "file":
            image, caption = Image.open(entry[1]), entry[2]
        elif entry[0] == "hub":
            ds, image_column, caption_column = hub
            row = ds[entry[2]]
            image, caption = row[image_column], str(row[caption_column])
        else:
            image = Image.open(BytesIO(_tar_read(entry[1], entry[2])))
            raw = _tar_read(entry[1], entry[3]).decode("utf-8-sig", errors="replace")
            caption = json.loads(raw).get("caption", "") if entry[3].endswith(".json") else raw.strip()
        image = image.convert("RGB")
    except (OSError, ValueError) as e:
        raise DataError(f"training.dataset_path: {entry[1]}{' ' + entry[2] if entry[0] == 'tar' else ''} is not a "
                        f"readable image ({e}); remove or replace it") from None
    w, h = image.size
    k = resolution / min(w, h)
    image = image.resize((max(resolution, round(w * k)), max(resolution, round(h * k))), Image.BICUBIC)
    w, h = image.size
    left, top = (w - resolution) // 2, (h - resolution) // 2
    return np.asarray(image.crop((left, top, left + resolution, top + resolution))), caption


class Pairs:
    """Sample i of the split: pair order_e[i mod N] of epoch e = i // N."""

    def __init__(self, kind: str, path: str, split: str, seed: int, resolution: int, bad=None):
        self.hub = hub_dataset(path) if kind == "hub" else None  # loaded once, read by every pair
        self.entries, self.seed, self.resolution = listing(kind, path, split, bad, self.hub), seed, resolution
        if not self.entries:
            raise DataError(f"training.dataset_path: no image-caption pairs for the {split} split in '{path}' "
                            f"({kind}; every {HOLD_OUT}th pair is held out); check the path and format")
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def pair_id(self, index: int) -> int:
        epoch, i = divmod(index, len(self.entries))
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.entries)))
        return int(self._order[1][i])

    def read(self, pair_id: int) -> tuple[np.ndarray, str]:
        return load(self.entries[pair_id], self.resolution, self.hub)

    def __call__(self, index: int) -> tuple[np.ndarray, str]:
        return self.read(self.pair_id(index))
