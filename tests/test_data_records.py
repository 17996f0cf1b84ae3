"""Raw data files (training.dataset = files): a .json array read element by element, and the launch's sample of
bad records (issue #27, items 5-7)."""

import functools
import json
import random

import pytest

from tessera.config.manager import help_text
from tessera.data import TokenLoader, documents, json_array
from tessera.data.prepare import plan_files
from tessera.data.records import BadRecords, DataError
from tessera.data.sample import RunReads, documents_read
from tessera.data.sources import check_files
from tessera.data.tokenizer import ByteTokenizer

ROWS = [{"id": k, "text": f"doc {k}: \"quoted\", [bracketed] {{braced}} \\ caf\u00e9 " * (k % 3 + 1)}
        for k in range(250)]
ROWS[7]["text"] = ""  # an empty document keeps its place, as in JSON Lines


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(json_array, "_CHUNK", 5)  # every element, string and escape straddles chunk ends


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_json_array_is_read_one_document_per_element_as_its_json_lines_would_be(tmp_path, small_chunks):
    lines = _write(tmp_path / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))
    compact = _write(tmp_path / "compact.json", json.dumps(ROWS))
    indented = _write(tmp_path / "indented.json", "\ufeff\n" + json.dumps(ROWS, indent=2, ensure_ascii=False))
    for split in ("train", "validation"):
        want = list(documents("files", lines, "text", split, 0, 0))
        assert len(want) == (247 if split == "train" else 2)
        for path in (compact, indented):
            assert list(documents("files", path, "text", split, 0, 0)) == want
    # The same documents, so the same samples on every DP rank, and the same position after a resume.

    def loader(path, rank, sample_index=0):
        ld = TokenLoader(ByteTokenizer(), functools.partial(documents, "files", path, "text", "train", 0), 16, 2,
                         rank, 2, streams=3)
        ld.load_state_dict({"sample_index": sample_index, "streams": 3})
        return [ld.next_batch()[0].tolist() for _ in range(3)]
    for rank in (0, 1):
        assert loader(indented, rank) == loader(lines, rank)
        assert loader(indented, rank, 8) == loader(lines, rank, 8)
        assert loader(indented, rank, 8)[0] == loader(indented, rank)[2]
    check_files(compact, "text", validation=True)  # the launch's pre-check reads it too
    # prepare cannot cut an array at a byte offset: the file is one piece (JSON Lines is cut).
    assert [(p["start"], p["end"]) for p in plan_files([compact], 1000)[1]] == [(0, None)]
    assert len(plan_files([lines], 1000)[1]) > 1
    assert ".json (one JSON array of objects, or JSON Lines)" in help_text()


def test_bad_elements_of_an_array_are_named_by_line_and_element(tmp_path, small_chunks):
    path = tmp_path / "bad.json"
    path.write_bytes(b'[\n  {"text": "a"},\n  {"text": 3}, 5, {"text": "b"},\n  {"text": "caf\xe9"}, , {"text": "c"},'
                     b'\n  {"id": 1}\n]\n\n  [{"text": "again"}]\n')
    seen = []
    bad = BadRecords(-1, quiet=True)
    bad.skip = lambda file, where, reason: seen.append(f"{where}: {reason}")
    assert list(documents("files", str(path), "text", "train", 0, 0, bad=bad)) == ["a", "b", "c"]
    assert seen == ["line 3 (element 2): 'text' is a number, not a string",
                    "line 3 (element 3): a number (JSON), not an object with a 'text' field",
                    "line 4 (element 5): bytes that are not UTF-8 (invalid continuation byte at column 14)",
                    "line 4 (element 6): not valid JSON (Expecting value at column 1)",
                    "line 5 (element 8): no field 'text'",
                    "line 8 (after the array): more data after the array's closing ']': a .json file holds one "
                    "array, or one JSON object per line"]
    path.write_bytes(b'[{"text": "a"},\n {"text": "cut')
    bad = BadRecords(-1, quiet=True)
    assert list(documents("files", str(path), "text", "train", 0, 0, bad=bad)) == ["a"]
    assert bad.examples == [f"{path}:2 (element 2): the file ends inside this element, before the array's closing "
                            f"']' (cut short?)"]
    path.write_text('[{"body": "x"}]')
    with pytest.raises(DataError, match=r"bad.json: no field 'text' \(training.dataset_text_field\); fields present: "
                                        r"\['body'\]"):
        list(documents("files", str(path), "text", "train", 0, 0))


@pytest.mark.fast
def test_a_byte_order_mark_starting_a_file_is_no_part_of_its_first_record(tmp_path):
    """UTF-8 with a byte-order mark (as editors on Windows save it): JSON Lines (.jsonl, and .json holding lines), a
    .txt document and chat records read as they do without it, the first record kept and no bad one counted."""
    from tessera.data.examples import file_rows

    lines = "".join(json.dumps(r) + "\n" for r in ROWS[:20])
    for name, text in (("rows.jsonl", lines), ("rows.json", lines), ("doc.txt", "a document\n")):
        (tmp_path / "plain").mkdir(exist_ok=True)
        (tmp_path / "marked").mkdir(exist_ok=True)
        plain, marked = tmp_path / "plain" / name, tmp_path / "marked" / name
        plain.write_text(text, encoding="utf-8")
        marked.write_text(text, encoding="utf-8-sig")
        assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
        bad = BadRecords(-1, quiet=True)
        want = list(documents("files", str(plain), "text", "train", 0, 0))
        assert list(documents("files", str(marked), "text", "train", 0, 0, bad=bad)) == want and bad.count == 0
        if name != "doc.txt":
            assert [row for row, _ in file_rows(marked, bad, "messages")] == ROWS[:20] and bad.count == 0


def _garbage(path, good_every: int, n: int = 300) -> str:
    """`n` records; one in `good_every` is a document, the others are cut off."""
    return _write(path, "".join((json.dumps({"text": f"document {k} " * 5}) if k % good_every == 0 else
                                 f'{{"text": "cut off {k}') + "\n" for k in range(n)))


def test_data_whose_sampled_bad_records_would_pass_the_limit_is_refused_before_launch(tmp_path):
    data = _garbage(tmp_path / "mostly_bad.jsonl", 3)
    long_run = RunReads(train_samples=1000 * 8, validation_samples=0, window=2049, streams=64)
    with pytest.raises(DataError) as info:
        check_files(data, "text", False, 100, long_run)
    assert str(info.value) == (
        f"training.max_bad_records: 200 of the first 300 records of {data} are bad; at that rate about 200 of the "
        f"~300 records this run reads would be, more than 100; the first: {data}:2: not valid JSON (Invalid "
        f"control character at column 20); {data}:3: not valid JSON (Invalid control character at column 20); "
        f"{data}:5: not valid JSON (Invalid control character at column 20); write one JSON object per line "
        f"(.jsonl), or one JSON array of objects (.json), each with its text in the string field 'text', or raise "
        f"training.max_bad_records (-1: no limit)")
    check_files(data, "text", False, 200, long_run)  # at the limit
    check_files(data, "text", False, -1, long_run)
    # A run that reads only the first records meets fewer of them: 8 windows of 33 tokens take 8 documents, but
    # the loader reads 64 at a time: 192 records (a third of them documents), and 100/99 of that for the held-out.
    short_run = RunReads(train_samples=8, validation_samples=0, window=33, streams=64)
    check_files(data, "text", False, 130, short_run)
    with pytest.raises(DataError, match=r"about 129 of the ~194 records this run reads would be, more than 128"):
        check_files(data, "text", False, 128, short_run)
    # Validation replays 1 record in 100: its windows need 100 records for each held-out document.
    with pytest.raises(DataError, match=r"about 200 of the ~300 records"):
        check_files(data, "text", True, 100, RunReads(8, 1, 33, 64))
    # Within the sample the bad records are counted where they are; beyond it, the file is taken at its rate.
    one_bad = tmp_path / "one_bad" / "d.jsonl"
    one_bad.parent.mkdir()
    one_bad.write_text("".join((json.dumps({"text": f"document {k:04} " * 5}) if k != 900 else "{") + "\n"
                               for k in range(3000)))
    check_files(str(one_bad), "text", False, 0, short_run)
    with pytest.raises(DataError, match=r"1 of the first 1000 records of .*d.jsonl are bad; at that rate about 4 of "
                                        r"the ~30\d\d records this run reads would be, more than 2; the first: "
                                        r".*d.jsonl:901: not valid JSON"):
        check_files(str(one_bad), "text", False, 2, long_run)
    # Over files: the run reads the first file, then the next; only what it reads counts.
    clean = _garbage(tmp_path / "a_clean.jsonl", 1)
    check_files(str(tmp_path), "text", False, 100, short_run)
    with pytest.raises(DataError, match=rf"200 of the first 300 records of {data} are bad; at that rate about 1\d\d "
                                        rf"of the ~4\d\d records this run reads would be, more than 100; the first: "
                                        rf"{data}:2: "):
        check_files(str(tmp_path), "text", False, 100, RunReads(8 * 4, 0, 33 * 8, 64))
    assert clean < data


def test_the_estimate_of_documents_read_is_below_what_the_loader_reads():
    rng = random.Random(0)
    docs = ["x" * rng.randint(1, 80) for _ in range(3000)]
    mean_tokens = sum(len(d) for d in docs) / len(docs) + 2
    for seq_len, batch, dp, streams, steps in [(8, 4, 1, 7, 10), (32, 8, 2, 64, 3), (100, 8, 1, 1, 3),
                                               (100, 2, 4, 64, 10), (255, 8, 1, 64, 4)]:
        pulled = []

        def each_document(epoch, pulled=pulled):
            for doc in docs:
                pulled.append(doc)
                yield doc
        for rank in range(dp):
            loader = TokenLoader(ByteTokenizer(), each_document, seq_len, batch, rank, dp, streams)
            for _ in range(steps):
                loader.next_batch()
        estimate = documents_read(steps * batch * dp, seq_len + 1, streams, mean_tokens)
        assert 64 <= estimate <= len(pulled) / dp < 5 * estimate, (seq_len, batch, dp, streams, steps)


def test_records_that_cannot_be_read_are_named_with_the_fix(tmp_path):
    pretty = _write(tmp_path / "one.json", json.dumps({"text": "a document"}, indent=2))  # one object, pretty
    with pytest.raises(DataError) as info:
        check_files(pretty, "text", validation=False)
    assert str(info.value) == (
        f"training.dataset_path: no document in {pretty}: its records are all bad or empty (3 bad; the first: "
        f"{pretty}:1: not valid JSON (Expecting property name enclosed in double quotes at column 1); {pretty}:2: "
        f"not valid JSON (Extra data at column 9); {pretty}:3: not valid JSON (Expecting value at column 1)); "
        f"write one JSON object per line (.jsonl), or one JSON array of objects (.json), each with its text in the "
        f"string field 'text'")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl:1: bytes that are not UTF-8 \(invalid continuation byte at "
                                        r"column 14\)\); convert the file to UTF-8 \(e.g. iconv -f latin1 -t utf-8\)$"):
        check_files(str(latin1), "text", validation=False)
    numbers = _write(tmp_path / "numbers.jsonl", '{"text": 1}\n{"text": 2}\n')
    with pytest.raises(DataError, match=r"set training.dataset_text_field to the field that holds each document's "
                                        r"text \(now 'text'\), or fix those records$"):
        check_files(numbers, "text", validation=False)
