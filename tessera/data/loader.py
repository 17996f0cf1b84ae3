"""Packs tokenized documents into fixed-length windows addressed by a global sample index."""

import functools
import itertools
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tessera.config import ConfigError
from tessera.config.sections import JobConfig
from tessera.data import tokens
from tessera.data.examples import example_loader_parts, read_from
from tessera.data.masks import split_windows
from tessera.data.records import BadRecords, DataError
from tessera.data.sources import documents
from tessera.data.tokenizer import Tokenizer, encode_documents

_ENCODE_CHUNK = 64  # documents per encode call: amortizes per-call overhead while bounding buffered text


class _Stream:
    """One packed stream: its unconsumed tokens, the number of the window they start at, and documents read for
    it but not yet tokenized (tokenized when the stream needs them, so a stream that others outran costs no
    tokenizing)."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int32)
        self.pos = 0  # first unconsumed token in buf
        self.window = 0  # the window that starts at pos
        self.texts: list[str] = []
        self.skip = 0  # tokens still to drop as they arrive: windows consumed before a resume


class TokenLoader:
    """An infinite stream of windows of `seq_len + 1` tokens (input = window[:-1], label = window[1:]).

    Documents are dealt round-robin to S = `streams` packed streams: stream s concatenates `[bos] + doc + [eos]`
    over documents s, s + S, s + 2S, ... of the endless document sequence (epoch after epoch), cut into windows;
    `encode` makes the tokens of a list of documents (default: that form; chat and prompt-completion examples,
    tessera/data/examples.py, mark their untrained tokens, tessera/data/masks.py). A document longer than what is
    left of a window continues in the stream's next window: nothing is dropped.
    Global sample i is window i // S of stream i % S. Each call hands out the next `local_batch_size * dp_degree`
    samples, rank r taking r, r + D, r + 2D, ... So the stream depends only on the global sample count and S:
    a checkpoint taken at one DP degree resumes exactly at another. Rank r reads every document but tokenizes only
    those of the streams it draws from, 1 / gcd(S, D) of them: tokenizing is what costs at scale.
    """

    def __init__(self, tokenizer: Tokenizer, docs: Callable[[int], Iterator], seq_len: int,
                 local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1, streams: int = 1,
                 encode: Callable[[list], list[np.ndarray]] | None = None):
        if seq_len < 1 or local_batch_size < 1 or streams < 1:
            raise ValueError(f"seq_len, local_batch_size and streams must be >= 1, got {seq_len}, "
                             f"{local_batch_size} and {streams}")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.streams = streams
        self._docs = docs
        self._encode = encode or functools.partial(encode_documents, tokenizer)
        self._window = seq_len + 1
        self.documents_tokenized = 0
        self._restart(0)

    def _restart(self, sample_index: int) -> None:
        """Read from the first document again, to hand out samples from `sample_index` on (global, all ranks).
        Replaying is the only way to a position that does not depend on how documents were tokenized.
        Each stream drops the tokens of windows before that as they arrive."""
        self.sample_index = sample_index
        self._epoch = 0
        self._doc_iter = iter(self._docs(0))
        self._epoch_has_docs = False
        self._next_doc = 0  # number of the next document read, counted over epochs
        first, D, S = sample_index + self.dp_rank, self.dp_degree, self.streams
        self._stream = {(first + D * m) % S: _Stream() for m in range(S)}  # the streams this rank draws from
        for s, st in self._stream.items():
            st.window = (sample_index - s + S - 1) // S  # samples below sample_index that fall in stream s
            st.skip = st.window * self._window

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), both LongTensor [local_batch_size, seq_len], for this rank."""
        first = self.sample_index + self.dp_rank
        windows = np.stack([self._take(first + self.dp_degree * j) for j in range(self.local_batch_size)])
        self.sample_index += self.local_batch_size * self.dp_degree
        return split_windows(windows)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def rewind(self) -> None:
        """Back to the first sample (validation replays the same held-out samples each time)."""
        self._restart(0)

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self.sample_index, "streams": self.streams}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "prepared" in state:
            raise ConfigError(f"training.dataset: the checkpoint's data position counts samples of prepared data "
                              f"({state['prepared']}), not of {self.streams} streams of documents; set "
                              f"training.dataset = 'tokenized' and its dataset_path to resume, or add dataloader to "
                              f"checkpoint.exclude_from_loading to start this data from its first sample")
        saved = int(state.get("streams", 1))
        if saved != self.streams:
            raise ConfigError(f"training.data_streams is {self.streams} but the checkpoint's data was dealt to "
                              f"{saved} streams; set --training.data_streams {saved} to resume this run")
        if int(state["sample_index"]) < 0:
            raise ValueError(f"dataloader state: sample_index must be >= 0, got {state['sample_index']}")
        self._restart(int(state["sample_index"]))

    def _take(self, sample: int) -> np.ndarray:
        st, window = self._stream[sample % self.streams], sample // self.streams
        # Windows between are other ranks': skip them whole buffered windows at a time.
        while st.window < window:
            self._fill(st, self._window)
            k = min(window - st.window, (len(st.buf) - st.pos) // self._window)
            st.pos, st.window = st.pos + k * self._window, st.window + k
        self._fill(st, self._window)
        st.pos, st.window = st.pos + self._window, st.window + 1
        return st.buf[st.pos - self._window:st.pos]

    def _fill(self, st: _Stream, n_tokens: int) -> None:
        """Make at least `n_tokens` unconsumed tokens available in `st`, a chunk of its documents at a time."""
        while len(st.buf) - st.pos < n_tokens:
            while not st.texts:
                self._deal()
            self._tokenize(st, _ENCODE_CHUNK)

    def _tokenize(self, st: _Stream, n_docs: int) -> None:
        """Move `st`'s next `n_docs` documents into its buffer as tokens, dropping those still to skip."""
        texts, st.texts = st.texts[:n_docs], st.texts[n_docs:]
        pieces = [st.buf[st.pos:]]
        for ids in self._encode(texts):
            drop = min(st.skip, len(ids))
            st.skip -= drop
            pieces.append(ids[drop:])
        st.buf, st.pos = np.concatenate(pieces), 0
        self.documents_tokenized += len(texts)

    def _deal(self) -> None:
        """Read the next documents, about a chunk of this rank's, and hand each to its stream."""
        for text in self._next_texts(_ENCODE_CHUNK * self.streams // len(self._stream)):
            stream, self._next_doc = self._next_doc % self.streams, self._next_doc + 1
            if stream in self._stream:
                self._stream[stream].texts.append(text)
        # While replaying to a resume position, every stream must tokenize what it skips anyway: do it as its
        # documents arrive, so that the streams not being read meanwhile do not pile up the replayed text.
        for st in self._stream.values():
            if st.skip and len(st.texts) >= _ENCODE_CHUNK:
                self._tokenize(st, len(st.texts))

    def _next_texts(self, n: int) -> list[str]:
        """Up to `n` next documents (fewer at the end of an epoch), moving on to the next epoch when it runs out."""
        while True:
            texts = list(itertools.islice(self._doc_iter, n))
            if texts:
                self._epoch_has_docs = True
                return texts
            if not self._epoch_has_docs:
                raise DataError(f"training.dataset: the data yielded no documents in epoch {self._epoch}; check "
                                f"training.dataset / dataset_path and the split")
            self._epoch += 1
            self._doc_iter = iter(self._docs(self._epoch))
            self._epoch_has_docs = False


def build_dataloader(cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, split: str = "train",
                     bad: BadRecords | None = None, accumulation: int = 1):
    """The loader for `split` of cfg.training.dataset; rank `dp_rank` of `dp_degree` data-parallel ranks: a
    TokenLoader, or a PreparedLoader for prepared data. `bad` counts the records skipped (one count for the splits
    of a run; default: a fresh one). `accumulation`: batches per optimizer step (ResolvedRun.batch)."""
    t = cfg.training
    if tokens.wanted(t):  # pre-tokenized, memory-mapped
        from tessera.data.prepared import build_prepared_loader

        return build_prepared_loader(cfg, tokenizer, dp_rank, dp_degree, split, accumulation)
    bad = BadRecords(t.max_bad_records) if bad is None else bad
    _, path, read = read_from(cfg, split)
    docs = functools.partial(documents, t.dataset, path, t.dataset_text_field, read, t.seed, bad=bad)
    encode = None
    if t.dataset_format != "text":
        docs, encode = example_loader_parts(t, cfg.model.hf_assets_path, tokenizer, path, read, bad)
    return TokenLoader(tokenizer, docs, t.seq_len, t.local_batch_size, dp_rank, dp_degree, t.data_streams, encode)
