"""Training from prepared (pre-tokenized) datasets: global sample i is a pure function of i, the seed and the
manifests, so every layout and DP degree sees the same order and a resume seeks in O(1).

A split's token stream (tessera/data/tokens.py) is cut into W windows of seq_len + 1 tokens (the tail that does not
fill one is left out). Sample n of a dataset is window perm_e(n mod W) of epoch e = n // W, where perm_e is a
pseudo-random permutation of [0, W) keyed by (seed, dataset, epoch): a Feistel network over the next power of 4 with
cycle-walking, evaluated per index, so no permutation array is ever built (the validation split is read in order).
A mixture deals its global samples to the datasets in blocks of 4096: each block gives dataset k exactly its share
c_k of the block (the weights rounded by largest remainder), interleaved evenly, so the count of each dataset among
samples [0, i) is closed-form. Rank r of D takes samples r, r + D, ... of each step's
local_batch_size x D, as the streaming loader does, and reads only their bytes from the memory-mapped shards.
"""

import logging

import numpy as np
import torch

from tessera.config import ConfigError
from tessera.data import tokens
from tessera.data.masks import split_windows
from tessera.data.records import DataError

log = logging.getLogger("tessera")
BLOCK = 4096  # samples per mixture block: each dataset's share is exact to 1/BLOCK within every block
_ROUNDS = 6


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping) arithmetic: a well-spread hash of each element."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key(*parts: int) -> int:
    """A 64-bit key from small non-negative integers (seed, dataset, epoch...)."""
    h = np.zeros(1, dtype=np.uint64)
    for p in parts:
        h = _mix(h ^ np.uint64(p))
    return int(h[0])


def permute(j: np.ndarray, n: int, k: int) -> np.ndarray:
    """perm(j) for each j in [0, n): a bijection of [0, n) keyed by `k` (balanced Feistel network over 2^(2h) >= n,
    outputs >= n walked on through the network until they land in range)."""
    j = np.asarray(j, dtype=np.uint64)
    if n <= 1:
        return j.copy()
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    round_keys = _mix(np.arange(1, _ROUNDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(k))
    out, todo = j.copy(), np.ones(len(j), dtype=bool)
    while todo.any():
        x = out[todo]
        for rk in round_keys:
            left, right = x >> np.uint64(half), x & mask
            x = (right << np.uint64(half)) | (left ^ (_mix(right ^ rk) & mask))
        out[todo] = x
        todo[todo] = x >= np.uint64(n)
    return out.astype(np.int64)


class Mixture:
    """Which dataset global sample i comes from, and which of that dataset's samples it is. Every block of BLOCK
    samples gives dataset k exactly c_k of them (the weights rounded by largest remainder), in the same order: each
    position to the dataset furthest below its share so far (Megatron's blending rule), so any run of samples holds
    each dataset's share within one sample."""

    def __init__(self, weights: list[float]):
        share = np.asarray(weights, dtype=np.float64) / sum(weights)
        counts = np.maximum(np.floor(share * BLOCK).astype(np.int64), 1)
        order = sorted(range(len(share)), key=lambda d: (-(share[d] * BLOCK - np.floor(share[d] * BLOCK)), d))
        for n in range(BLOCK - int(counts.sum())):  # largest remainders first
            counts[order[n % len(order)]] += 1
        while counts.sum() > BLOCK:  # a tiny weight raised to 1 takes from the largest
            counts[int(np.argmax(counts))] -= 1
        self.counts = counts
        self.order = np.empty(BLOCK, dtype=np.int64)
        taken = np.zeros(len(counts), dtype=np.int64)
        for p in range(BLOCK):
            self.order[p] = int(np.argmax(counts * (p + 1) - taken * BLOCK))  # the largest deficit; ties: lowest
            taken[self.order[p]] += 1
        assert (taken == counts).all()
        self.before = np.zeros((len(counts), BLOCK + 1), dtype=np.int64)  # each dataset's count before position p
        self.before[:, 1:] = np.cumsum(self.order[None, :] == np.arange(len(counts))[:, None], axis=1)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, its own sample number) of each global sample."""
        block, pos = np.divmod(samples, BLOCK)
        which = self.order[pos]
        return which, block * self.counts[which] + self.before[which, pos]

    def taken(self, n: int) -> np.ndarray:
        """How many of the global samples [0, n) each dataset gave."""
        return (n // BLOCK) * self.counts + self.before[:, n % BLOCK]


class PreparedLoader:
    """Windows of seq_len + 1 tokens from prepared datasets, mixed by weight; the TokenLoader interface
    (next_batch, rewind, state_dict / load_state_dict). `bytes_read`: what this rank read from the shards; a
    mixture logs its realized shares every `log_every` batches."""

    def __init__(self, parts: list[tokens.TokenShards], names: list[str], weights: list[float], seq_len: int,
                 local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1, seed: int = 0, shuffle: bool = True,
                 identity: str = "", log_every: int = 0):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        self.parts, self.names, self.weights = parts, names, [w / sum(weights) for w in weights]
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seed, self.shuffle, self.identity, self.log_every = seed, shuffle, identity, log_every
        self._window = seq_len + 1
        self.windows = [p.tokens // self._window for p in parts]
        if min(self.windows) < 1:
            small = self.windows.index(min(self.windows))
            raise DataError(f"training.seq_len: the {parts[small].split} split of {parts[small].folder} holds "
                            f"{parts[small].tokens} tokens, less than one window of {self._window}")
        self.mixture = Mixture(self.weights) if len(parts) > 1 else None
        self.sample_index, self._calls = 0, 0

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.parts)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, window of its split) of each global sample: what the order is made of."""
        samples = np.asarray(samples, dtype=np.int64)
        which, nth = self.mixture.locate(samples) if self.mixture else (np.zeros_like(samples), samples)
        window = np.empty_like(nth)
        for d in np.unique(which):
            sel = which == d
            epoch, j = np.divmod(nth[sel], self.windows[d])
            if not self.shuffle:
                window[sel] = j
                continue
            out = np.empty_like(j)
            for e in np.unique(epoch):
                at = epoch == e
                out[at] = permute(j[at], self.windows[d], key(self.seed, int(d), int(e)))
            window[sel] = out
        return which, window

    def samples(self, samples: np.ndarray) -> np.ndarray:
        """The windows [len(samples), seq_len + 1] of these global samples."""
        which, window = self.locate(samples)
        return np.stack([self.parts[d].read(int(w) * self._window, self._window) for d, w in zip(which, window,
                                                                                                 strict=True)])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), both LongTensor [local_batch_size, seq_len], for this rank."""
        mine = self.sample_index + self.dp_rank + self.dp_degree * np.arange(self.local_batch_size)
        windows = self.samples(mine)
        self.sample_index += self.local_batch_size * self.dp_degree
        self._calls += 1
        if self.mixture is not None and self.log_every and self._calls % self.log_every == 0 and self.dp_rank == 0:
            log.info(f"data mix over samples [0, {self.sample_index:,}): {self.describe_shares()}")
        return split_windows(windows)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def shares(self, n: int | None = None) -> dict[str, float]:
        """The realized share of each dataset among the global samples [0, n) (default: those handed out)."""
        n = self.sample_index if n is None else n
        taken = self.mixture.taken(n) if self.mixture else np.array([n])
        return {name: float(c) / max(n, 1) for name, c in zip(self.names, taken, strict=True)}

    def describe_shares(self) -> str:
        return ", ".join(f"{name} {share:.1%} (weight {w:.1%})" for (name, share), w in
                         zip(self.shares().items(), self.weights, strict=True))

    def rewind(self) -> None:
        self.sample_index = 0

    def state_dict(self) -> dict:
        return {"sample_index": self.sample_index, "prepared": self.identity}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("prepared")
        if saved != self.identity:
            was = (f"prepared data {saved}" if saved is not None else
                   f"a streaming dataset ({state.get('streams', 1)} streams)")
            raise ConfigError(f"training.dataset: the checkpoint's data position counts samples of {was}, not of "
                              f"this run's {self.identity}; resume with the data it trained on, or add dataloader to "
                              f"checkpoint.exclude_from_loading to start this data from its first sample")
        if int(state["sample_index"]) < 0:
            raise ValueError(f"dataloader state: sample_index must be >= 0, got {state['sample_index']}")
        self.sample_index = int(state["sample_index"])
        if self.mixture is not None and self.dp_rank == 0:
            log.info(f"data mix over samples [0, {self.sample_index:,}): {self.describe_shares()}")


def build_prepared_loader(cfg, tokenizer, dp_rank: int, dp_degree: int, split: str = "train",
                          accumulation: int = 1) -> PreparedLoader:
    """The loader of `split` of the run's prepared dataset(s); the tokenizer must be the one they were made with.
    `accumulation`: batches per optimizer step, so that a mixture's shares are logged every metrics.log_freq
    steps."""
    t = cfg.training
    parts, names, weights, ids = [], [], [], []
    for name, folder, weight, option in tokens.sources(t):
        manifest = tokens.read_manifest(folder, option)
        made = manifest["tokenizer"]
        ours = {"vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
        if any(made[k] != v for k, v in ours.items()):
            raise ConfigError(f"{option}: {folder} was prepared with a tokenizer of {made['vocab_size']} tokens, BOS "
                              f"{made['bos_id']}, EOS {made['eos_id']}; this run's has {ours['vocab_size']}, "
                              f"{ours['bos_id']}, {ours['eos_id']}; use the tokenizer it was made with")
        parts.append(tokens.TokenShards(folder, manifest, split, option, check=False))  # validate() did
        names.append(name)
        weights.append(weight)
        ids.append(f"{name}={tokens.fingerprint(manifest)}" + (f":{weight:g}" if t.dataset_mix else ""))
    identity = f"{','.join(ids)} seq_len={t.seq_len} seed={t.seed}"
    loader = PreparedLoader(parts, names, weights, t.seq_len, t.local_batch_size, dp_rank, dp_degree, t.seed,
                            shuffle=split == "train", identity=identity,
                            log_every=cfg.metrics.log_freq * accumulation if split == "train" else 0)
    if dp_rank == 0:
        shares = loader.mixture.counts / BLOCK if loader.mixture else [1.0]
        held = ", ".join(f"{n}: {p.tokens:,} tokens, {w:,} windows, {c:.1%} of the samples"
                         for n, p, w, c in zip(names, parts, loader.windows, shares, strict=True))
        detected = " (training.dataset_path is a prepared folder: read as tokenized)" if t.dataset == "files" else ""
        log.info(f"data ({split}): prepared, memory-mapped{detected}; {held}")
    return loader
