"""Chat and prompt-completion examples (training.dataset_format): records -> rendered examples (tessera/data/chat.py)
-> token ids whose untrained tokens are marked (tessera/data/masks.py), packed by the loader like documents.

Each example is `[bos] + its tokens` (a template that starts with the BOS token keeps its own); BOS and every token
outside a trained span are not trained. A chat record is bad (counted with its file and line, training.
max_bad_records) when it is not an object, has no messages list of {role, content} objects with string contents, has
a role outside ROLES, an empty assistant turn, no assistant turn (nothing to train), or the template refuses it; a
prompt-completion record when its prompt or completion is not a string or its completion is empty."""

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.data import chat
from tessera.data.masks import untrained
from tessera.data.records import BadRecords, DataError, json_object, json_records
from tessera.data.sample import SAMPLE_RECORDS, FileSample, RunReads, over_limit
from tessera.data.sources import _FILES_HOLDOUT_MOD, WHOLE, _resolve_files, check_dataset, check_split, hub_rows
from tessera.data.tokenizer import ByteTokenizer, Tokenizer

PROMPT, COMPLETION = "prompt", "completion"


@dataclass(frozen=True)
class ExampleFormat:
    """How a run's records become examples."""
    kind: str  # chat | prompt_completion
    messages_field: str
    template: chat.JinjaTemplate | chat.PlainTemplate
    assistant_only: bool

    def fields(self) -> str:
        return f"a {self.messages_field!r} list" if self.kind == "chat" else f"string fields {PROMPT!r} and " \
                                                                              f"{COMPLETION!r}"

    def render(self, row: dict) -> list[chat.Rendered]:
        """The example(s) of a record; TemplateError (a bad record) saying what is wrong with it."""
        if self.kind == "prompt_completion":
            return [self._prompt_completion(row)]
        field = self.messages_field
        if field not in row and field == "messages" and SHAREGPT in row:  # a ShareGPT record
            field = SHAREGPT
        messages = row.get(field)
        if messages is None:
            raise chat.TemplateError(f"no field {self.messages_field!r} (training.dataset_messages_field)")
        if not isinstance(messages, list) or not messages:
            raise chat.TemplateError(f"{field!r} is not a non-empty list of messages")
        messages = [_message(k, m) for k, m in enumerate(messages, 1)]
        if self.assistant_only and not any(m["role"] == "assistant" for m in messages):
            raise chat.TemplateError("no assistant turn: nothing to train (training.assistant_only_loss)")
        context = chat.Context(**{key: _objects(row, key) for key in ("tools", "documents")})
        return self.template.conversation(messages, self.assistant_only, context)

    def _prompt_completion(self, row: dict) -> chat.Rendered:
        prompt, completion = row.get(PROMPT), row.get(COMPLETION)
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise chat.TemplateError(f"{PROMPT!r} and {COMPLETION!r} must both be strings")
        if not completion.strip():
            raise chat.TemplateError(f"an empty {COMPLETION!r}: nothing to train")
        text = prompt + completion
        return chat.Rendered(text, ((len(prompt) if self.assistant_only else 0, len(text)),), (len(text),))


def example_format(t, hf_assets_path: str) -> ExampleFormat:
    return ExampleFormat(t.dataset_format, t.dataset_messages_field, chat.build_template(hf_assets_path,
                                                                                        t.chat_template),
                         t.assistant_only_loss)


# --- reading records -----------------------------------------------------------------------------------------

def file_rows(file: Path, bad: BadRecords, wants: str, start: int = 0,
              end: int | None = None) -> Iterator[tuple[dict | None, str]]:
    """(the object or None when bad, where) of each record of a .jsonl / .json / .parquet file; of a piece of it
    with `start`/`end` (as records.file_texts)."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq  # deferred: pyarrow is only needed for parquet inputs

        parquet, groups = pq.ParquetFile(file), range(start, end) if end is not None else None
        n = sum(parquet.metadata.row_group(g).num_rows for g in range(start)) if groups else 0
        for batch in parquet.iter_batches(batch_size=256, row_groups=groups):  # bounded memory
            for row in batch.to_pylist():
                n += 1
                yield row, f"row {n}"
        return
    if file.suffix == ".txt":
        raise DataError(f"training.dataset_path: {file} is a .txt file (one text document), but "
                        f"training.dataset_format = 'chat' / 'prompt_completion' reads records with {wants}: use "
                        f".jsonl, .json or .parquet files")
    with open(file, "rb") as f:
        for where, raw, _, problem in json_records(f, file, start, end):
            yield (bad.skip(file, where, problem) if problem is not None else
                   json_object(raw, file, where, bad, wants)), where


def _examples_of(fmt: ExampleFormat, row: dict | None, source, where: str, bad: BadRecords) -> list[chat.Rendered]:
    if row is None:
        return []
    try:
        return fmt.render(row)
    except chat.TemplateError as e:
        bad.skip(source, where, str(e))
        return []


def examples(fmt: ExampleFormat, dataset: str, path: str, split: str, seed: int, epoch: int,
             bad: BadRecords) -> Iterator[chat.Rendered]:
    """The examples of `split` for one epoch, in the order and with the held-out split text documents have
    (files: record 100, 200, ... held out; hub: its splits, training shuffled)."""
    check_split(dataset, split)
    check_dataset(dataset, path)
    if dataset == "stdlib":
        raise DataError("training.dataset_format: the stdlib corpus is text; chat and prompt_completion data come "
                        "from files (training.dataset = 'files'), a hub dataset or a prepared folder")
    if dataset != "files":
        rows, source = hub_rows(dataset, path, split, seed, epoch)
        for n, row in enumerate(rows, 1):
            yield from _examples_of(fmt, row, source, f"row {n}", bad)
        return
    want_val, k = split == "validation", 0
    for file in _resolve_files(path):
        for row, where in file_rows(file, bad, fmt.fields()):
            if split == WHOLE or (k % _FILES_HOLDOUT_MOD == _FILES_HOLDOUT_MOD - 1) == want_val:
                yield from _examples_of(fmt, row, file, where, bad)
            k += 1


# --- tokens --------------------------------------------------------------------------------------------------

SHAREGPT = "conversations"  # ShareGPT's records: {"conversations": [{"from": "human", "value": ...}, ...]}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}


def _message(k: int, m) -> dict:
    """Message `k` of a record as the templates take it (a ShareGPT one's `from` and `value` as role and content),
    or TemplateError saying what is wrong with it."""
    if isinstance(m, dict) and "from" in m and "role" not in m:
        if m["from"] not in SHAREGPT_ROLES:
            raise chat.TemplateError(f"message {k} is from {m['from']!r}, not one of ShareGPT's roles "
                                     f"({', '.join(SHAREGPT_ROLES)})")
        m = {"role": SHAREGPT_ROLES[m["from"]], "content": m.get("value"),
             **{key: v for key, v in m.items() if key not in ("from", "value")}}
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise chat.TemplateError(f"message {k} is not an object with a string 'role'")
    if m["role"] not in chat.ROLES:
        raise chat.TemplateError(f"message {k} has role {m['role']!r}, not one the templates know "
                                 f"({', '.join(chat.ROLES)})")
    content, calls = m.get("content"), m.get("tool_calls")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise chat.TemplateError(f"message {k} has a {kind!r} content part; only text parts are trained on")
    elif content is not None and not isinstance(content, str):
        raise chat.TemplateError(f"message {k}'s 'content' is neither a string nor a list of text parts")
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
        raise chat.TemplateError(f"message {k}'s 'tool_calls' is not a list of objects")
    if m["role"] == "assistant" and not chat.text_of(content).strip() and not calls:
        raise chat.TemplateError(f"message {k} is an empty assistant turn")
    if content is None and not calls:
        raise chat.TemplateError(f"message {k} has no 'content'")
    return m


def _objects(row: dict, key: str) -> list | None:
    """A record's `tools` or `documents`: a list of objects, or None."""
    value = row.get(key)
    if value is not None and (not isinstance(value, list) or not all(isinstance(v, dict) for v in value)):
        raise chat.TemplateError(f"{key!r} is not a list of objects")
    return value


def encode_examples(tok: Tokenizer, rendered: list[chat.Rendered]) -> list[np.ndarray]:
    """Each example as int32 `[bos] + ids`, its untrained tokens marked. A template's text with no EOS to insert
    is tokenized whole (the ids `transformers`' apply_chat_template gives), a token trained when its characters
    overlap a trained span; otherwise (the plain template, prompt-completion) each piece between span ends and
    EOS places is tokenized apart (the byte tokenizer gives the same either way)."""
    return [_encode(tok, r) for r in rendered]


def _encode(tok: Tokenizer, r: chat.Rendered) -> np.ndarray:
    if not r.eos_at and hasattr(tok, "encode_offsets"):
        ids, offsets = tok.encode_offsets(r.text)
        ids, trained = np.asarray(ids, dtype=np.int32), np.zeros(len(ids), dtype=bool)
        for start, end in r.spans:
            trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    else:
        ids, trained = _pieces(tok, r)
    if not len(ids) or ids[0] != tok.bos_id:
        ids, trained = np.concatenate([[tok.bos_id], ids]).astype(np.int32), np.concatenate([[False], trained])
    trained[0] = False
    return np.where(trained, ids, untrained(ids))


def _pieces(tok: Tokenizer, r: chat.Rendered) -> tuple[np.ndarray, np.ndarray]:
    cuts = sorted({0, len(r.text), *r.eos_at, *(p for span in r.spans for p in span)})
    ids, trained = [], []
    for start, end in itertools.pairwise(cuts):
        piece = _ids(tok, r.text[start:end])
        ids.append(piece)
        trained.append(np.full(len(piece), any(s <= start and end <= e for s, e in r.spans)))
        if end in r.eos_at:
            ids.append(np.array([tok.eos_id], dtype=np.int32))
            trained.append(np.array([any(s < end <= e for s, e in r.spans)]))
    return np.concatenate(ids).astype(np.int32), np.concatenate(trained).astype(bool)


def _ids(tok: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return np.asarray(tok.encode(text), dtype=np.int32)


def example_loader_parts(t, hf_assets_path: str, tokenizer: Tokenizer, path: str, split: str, bad: BadRecords):
    """(docs, encode) for a TokenLoader over the examples of `split` of `path`."""
    fmt = example_format(t, hf_assets_path)
    docs = functools.partial(examples, fmt, t.dataset, path, split, t.seed, bad=bad)
    return docs, functools.partial(encode_examples, tokenizer)


def sample_examples(fmt: ExampleFormat, file: Path, n: int = SAMPLE_RECORDS) -> FileSample:
    """The first `n` records of a chat or prompt-completion file, as tessera.data.sample reads text files: its
    examples in place of documents, the UTF-8 bytes of their rendered text (no tokenizer makes more tokens). Its
    records are counted up to the sample's end only (a lower bound: never a refusal the file would not earn)."""
    bad, records, examples_, text_bytes, bad_so_far = BadRecords(-1, quiet=True), 0, 0, 0, []
    for row, where in itertools.islice(file_rows(file, bad, fmt.fields()), n):
        rendered = _examples_of(fmt, row, file, where, bad)
        records, examples_ = records + 1, examples_ + len(rendered)
        text_bytes += sum(len(r.text.encode("utf-8")) for r in rendered)
        bad_so_far.append(bad.count)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq  # deferred: pyarrow is only needed for parquet inputs

        total = pq.ParquetFile(file).metadata.num_rows
    else:
        total = records
    return FileSample(file, records, examples_, text_bytes, bad, total, bad_so_far)


def check_examples(cfg, reads: RunReads | None = None) -> None:
    """Before launch: chat or prompt-completion data a run can read: a template that compiles, not the text-only
    built-in corpus, and local files holding an example to train (and one held out, with validation); with
    `reads`, a sample of their records (the first of each file, file after file) whose rate of bad ones would not
    pass training.max_bad_records over the records the run reads (tessera/data/sample.py)."""
    from tessera.data import tokens  # the prepared-data side, checked by its own check

    t = cfg.training
    fmt = example_format(t, cfg.model.hf_assets_path)
    if t.dataset != "files" or tokens.wanted(t):
        if t.dataset == "stdlib":
            next(examples(fmt, t.dataset, t.dataset_path, "train", t.seed, 0, BadRecords(-1, quiet=True)))
        return
    for split in ("train", "validation") if cfg.validation.enable else ("train",):
        bad, (key, path, read) = BadRecords(-1, quiet=True), read_from(cfg, split)
        if next(examples(fmt, t.dataset, path, read, t.seed, 0, bad), None) is None:
            why = f"; {bad.count} bad records, the first: {bad.first}" if bad.count else ""
            fix = "add data (record 100, 200, ... are held out), or set validation.enable = false" \
                if read == "validation" else "add data"
            raise DataError(f"{key}: no {t.dataset_format} example in the {read} split of {path!r} "
                            f"({fmt.fields()} per record){why}; {fix}")
    if reads is not None:
        over_limit(_resolve_files(t.dataset_path), lambda file: sample_examples(fmt, file), t.max_bad_records, reads,
                   lambda worst: f"fix or remove those records ({fmt.fields()} each)")


def read_from(cfg, split: str) -> tuple[str, str, str]:
    """(the option naming it, path, split to read) of the run's `split`: validation.dataset_path read whole when
    it is set, else the split of training.dataset_path."""
    if split == "validation" and cfg.validation.dataset_path:
        return "validation.dataset_path", cfg.validation.dataset_path, WHOLE
    return "training.dataset_path", cfg.training.dataset_path, split


# --- prepared data (python -m tessera.data.prepare --format chat) ---------------------------------------------

def prepared_format(spec: dict | None, tokenizer_path: str) -> ExampleFormat | None:
    """A prepare request's "examples" entry ({kind, messages_field, chat_template, assistant_only}; None: text)."""
    if not spec:
        return None
    return ExampleFormat(spec["kind"], spec["messages_field"], chat.build_template(tokenizer_path,
                                                                                 spec["chat_template"]),
                         spec["assistant_only"])


def piece_examples(fmt: ExampleFormat, file: Path, bad: BadRecords, start: int = 0,
                   end: int | None = None) -> Iterator[chat.Rendered]:
    """The examples of a piece of a file, bad records counted."""
    for row, where in file_rows(file, bad, fmt.fields(), start, end):
        yield from _examples_of(fmt, row, file, where, bad)
