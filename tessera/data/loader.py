"""Packs tokenized documents into fixed-length windows addressed by a global sample index."""

import functools
import itertools
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tessera.config.sections import JobConfig
from tessera.data.sources import documents
from tessera.data.tokenizer import ByteTokenizer, Tokenizer

_ENCODE_CHUNK = 64  # documents per encode call: amortizes per-call overhead while bounding buffered text


class TokenLoader:
    """An infinite stream of windows cut from the concatenation of `[bos] + doc + [eos]` over all documents.

    Sample i is window i of `seq_len + 1` tokens (input = window[:-1], label = window[1:]). Samples are
    numbered globally and each call hands rank r its slice of the next `local_batch_size * dp_degree`, so the
    stream depends only on that global count: a checkpoint taken at one DP degree resumes exactly at another.
    """

    def __init__(self, tokenizer: Tokenizer, docs: Callable[[int], Iterator[str]], seq_len: int,
                 local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1):
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len and local_batch_size must be >= 1, got {seq_len} and {local_batch_size}")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self._docs = docs
        self._window = seq_len + 1
        self._restart()

    def _restart(self) -> None:
        self.sample_index = 0  # global samples consumed, over all ranks
        self._epoch = 0
        self._doc_iter = iter(self._docs(0))
        self._epoch_has_docs = False
        self._buf = np.empty(0, dtype=np.int64)
        self._pos = 0  # first unconsumed token in _buf

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), both LongTensor [local_batch_size, seq_len], for this rank."""
        n = self.local_batch_size
        self._skip(self.dp_rank * n)
        windows = self._take(n)
        self._skip((self.dp_degree - 1 - self.dp_rank) * n)
        return torch.tensor(windows[:, :-1]), torch.tensor(windows[:, 1:])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self.sample_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Replaying from the start is the only position that does not depend on how documents were tokenized
        # and buffered; every rank replays the same global stream, so the DP layout may change across resume.
        self._restart()
        self._skip(int(state["sample_index"]))

    def _take(self, n: int) -> np.ndarray:
        self._fill(n * self._window)
        windows = self._buf[self._pos:self._pos + n * self._window].reshape(n, self._window)
        self._pos += n * self._window
        self.sample_index += n
        return windows

    def _skip(self, n: int) -> None:
        # Whole buffered windows at a time, so skipping far ahead never holds more than one chunk of tokens.
        while n > 0:
            self._fill(self._window)
            k = min(n, (len(self._buf) - self._pos) // self._window)
            self._pos += k * self._window
            self.sample_index += k
            n -= k

    def _fill(self, n_tokens: int) -> None:
        """Make at least `n_tokens` unconsumed tokens available, dropping the consumed ones."""
        pieces = [self._buf[self._pos:]]
        available = len(pieces[0])
        while available < n_tokens:
            pieces.append(self._encode(self._next_texts()))
            available += len(pieces[-1])
        if len(pieces) > 1:
            self._buf, self._pos = np.concatenate(pieces), 0

    def _next_texts(self) -> list[str]:
        """The next chunk of documents, moving on to the next epoch when this one runs out."""
        while True:
            texts = list(itertools.islice(self._doc_iter, _ENCODE_CHUNK))
            if texts:
                self._epoch_has_docs = True
                return texts
            if not self._epoch_has_docs:
                raise ValueError(f"the dataset yielded no documents in epoch {self._epoch}; "
                                 f"check training.dataset / dataset_path and the split")
            self._epoch += 1
            self._doc_iter = iter(self._docs(self._epoch))
            self._epoch_has_docs = False

    def _encode(self, texts: list[str]) -> np.ndarray:
        tok = self.tokenizer
        if isinstance(tok, ByteTokenizer):
            ids = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]  # skips a Python int per byte
        elif hasattr(tok, "encode_batch"):
            ids = tok.encode_batch(texts)
        else:
            ids = [tok.encode(t) for t in texts]
        bos, eos = np.array([tok.bos_id]), np.array([tok.eos_id])
        return np.concatenate([part for doc in ids for part in (bos, np.asarray(doc, dtype=np.int64), eos)])


def build_dataloader(cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int,
                     split: str = "train") -> TokenLoader:
    """The loader for `split` of cfg.training.dataset; rank `dp_rank` of `dp_degree` data-parallel ranks."""
    t = cfg.training
    docs = functools.partial(documents, t.dataset, t.dataset_path, t.dataset_text_field, split, t.seed)
    return TokenLoader(tokenizer, docs, t.seq_len, t.local_batch_size, dp_rank, dp_degree)
