"""Tokenizers: a built-in byte tokenizer (no files needed) and a Hugging Face `tokenizer.json` wrapper."""

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from tessera.config.manager import ConfigError

# Tried in order when tokenizer_config.json does not name a usable BOS/EOS (Llama 3, Llama 2/Mistral, GPT-2, Gemma).
_BOS_FALLBACKS = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "<bos>")
_EOS_FALLBACKS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; two extra ids mark document boundaries."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Windows may cut a multi-byte character in half, so decoding must not fail on partial bytes.
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` fast tokenizer loaded from `<folder>/tokenizer.json`."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as _Tokenizer  # deferred: only needed when a folder is configured

        self.folder = folder = Path(folder)
        try:
            self._tok = _Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt file
            raise ConfigError(f"model.hf_assets_path: {folder / 'tokenizer.json'} is not a tokenizer `tokenizers` "
                              f"reads ({str(e).splitlines()[0][:200]}); download it again") from None
        config_file = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except ValueError as e:
            raise ConfigError(f"model.hf_assets_path: {config_file} is not valid JSON ({e})") from None
        self.bos_id = self._special_id(config.get("bos_token"), _BOS_FALLBACKS, "BOS", folder)
        self.eos_id = self._special_id(config.get("eos_token"), _EOS_FALLBACKS, "EOS", folder)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _special_id(self, configured, fallbacks: tuple[str, ...], kind: str, folder: Path) -> int:
        # tokenizer_config.json stores specials either as "<s>" or as an AddedToken dict {"content": "<s>", ...}.
        if isinstance(configured, dict):
            configured = configured.get("content")
        candidates = ([configured] if configured else []) + list(fallbacks)
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ConfigError(f"model.hf_assets_path: no {kind} token found in {folder}: tried {candidates}; "
                          f"set {kind.lower()}_token in tokenizer_config.json")

    def encode(self, text: str) -> list[int]:
        # BOS/EOS are added by the loader at document boundaries, never by the tokenizer's template.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[list[int], np.ndarray]:
        """The ids of `text` and each one's [start, end) characters in it ([n, 2])."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each document as `[bos] + ids + [eos]`, int32 (vocabularies are far below 2**31; halves the buffers)."""
    if isinstance(tok, ByteTokenizer):
        ids = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]  # skips a Python int per byte
    elif hasattr(tok, "encode_batch"):
        ids = tok.encode_batch(texts)
    else:
        ids = [tok.encode(t) for t in texts]
    bos, eos = np.array([tok.bos_id], dtype=np.int32), np.array([tok.eos_id], dtype=np.int32)
    return [np.concatenate([bos, np.asarray(doc, dtype=np.int32), eos]) for doc in ids]


def build_tokenizer(hf_assets_path: str) -> ByteTokenizer | HFTokenizer:
    """Empty path -> ByteTokenizer; otherwise the folder's tokenizer.json."""
    if not hf_assets_path:
        return ByteTokenizer()
    tokenizer_file = Path(hf_assets_path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"model.hf_assets_path: {tokenizer_file} not found; leave model.hf_assets_path empty for "
                          f"the built-in byte tokenizer")
    return HFTokenizer(hf_assets_path)
