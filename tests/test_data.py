"""Tests for tessera.data: tokenizers, document sources and the packing loader."""

import json
import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tessera.config import ConfigError
from tessera.data import TokenLoader, build_dataloader, build_tokenizer, documents
from tessera.data.records import BadRecords, DataError
from tessera.data.sources import _stdlib_files, check_files
from tessera.data.tokenizer import ByteTokenizer, HFTokenizer
from tessera.schema import JobConfig

B, E = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def random_corpus(n_docs: int):
    """epoch -> documents; each epoch a different order, so wrap-around is visible in the stream."""
    rng = random.Random(123)
    docs = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, 30))) for _ in range(n_docs)]

    def for_epoch(epoch: int):
        shuffled = list(docs)
        random.Random(epoch).shuffle(shuffled)
        return iter(shuffled)

    return for_epoch


def batches(loader: TokenLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def interleave(rows: list[torch.Tensor]) -> torch.Tensor:
    """Global batch order from per-rank batches: rank r holds global rows r, r + D, r + 2D, ..."""
    return torch.stack(rows, dim=1).flatten(0, 1)


def dp_batches(docs, seq_len: int, local: int, dp: int, n: int, state=None, streams: int = 1):
    """n global batches from `dp` ranks, each in global sample order."""
    loaders = [TokenLoader(ByteTokenizer(), docs, seq_len, local, rank, dp, streams) for rank in range(dp)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    per_rank = [batches(loader, n) for loader in loaders]
    merged = [(interleave([r[i][0] for r in per_rank]), interleave([r[i][1] for r in per_rank])) for i in range(n)]
    return merged, per_rank, loaders


def assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# --- tokenizers -------------------------------------------------------------------------------------------

def test_byte_tokenizer_roundtrip_and_specials():
    tok = build_tokenizer("")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 258
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode()) and max(ids) < 256
    assert tok.decode([B] + ids + [E]) == "héllo"
    assert tok.decode(ids[:2]) == "h\ufffd"  # a cut multi-byte character decodes, replaced


def make_hf_folder(folder, specials=("<unk>", "<s>", "</s>"), config=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox", "tessera trains models"] * 5, trainer)
    if "<s>" in specials:  # a template that adds specials, which encode() must not apply
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def test_hf_tokenizer_loads_and_roundtrips(tmp_path):
    raw = make_hf_folder(tmp_path / "tok", config={"bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    tok = build_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (raw.token_to_id("<s>"), raw.token_to_id("</s>")) == (1, 2)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    text = "hello tessera, the fox!"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text
    assert tok.encode_batch([text, "world"]) == [ids, tok.encode("world")]


def test_hf_tokenizer_special_fallbacks(tmp_path):
    make_hf_folder(tmp_path / "plain")  # no tokenizer_config.json: common names are tried
    tok = build_tokenizer(str(tmp_path / "plain"))
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    make_hf_folder(tmp_path / "nospecial", specials=("<unk>",), config={"bos_token": "<bos_missing>"})
    with pytest.raises(ValueError, match="no BOS token found"):
        build_tokenizer(str(tmp_path / "nospecial"))


def test_build_tokenizer_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json") as info:
        build_tokenizer(str(tmp_path))
    assert "\n" not in str(info.value)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # cut off mid-download
    with pytest.raises(ConfigError, match=rf"model.hf_assets_path: {tmp_path / 'tokenizer.json'} is not a tokenizer"):
        build_tokenizer(str(tmp_path))


# --- loader ----------------------------------------------------------------------------------------------

def test_exact_packing_and_epoch_wraparound():
    epochs_asked = []

    def docs(epoch):
        epochs_asked.append(epoch)
        return iter(["ab", f"cd{epoch}"])  # 4 + 5 = 9 tokens per epoch, so windows straddle epochs

    loader = TokenLoader(ByteTokenizer(), docs, seq_len=3, local_batch_size=2)
    a, b, c, d, zero, one = map(ord, "abcd01")
    windows = [[B, a, b, E], [B, c, d, zero], [E, B, a, b], [E, B, c, d], [one, E, B, a]]
    x1, y1 = loader.next_batch()
    x2, y2 = loader.next_batch()
    assert x1.dtype == torch.long and x1.shape == (2, 3)
    assert x1.tolist() == [w[:-1] for w in windows[:2]] and y1.tolist() == [w[1:] for w in windows[:2]]
    assert x2.tolist() == [w[:-1] for w in windows[2:4]] and y2.tolist() == [w[1:] for w in windows[2:4]]
    assert loader.state_dict() == {"sample_index": 4, "streams": 1}
    x3, _ = loader.next_batch()
    assert x3[0].tolist() == windows[4][:-1]
    assert epochs_asked == [0, 1, 2]


def test_empty_epoch_raises():
    loader = TokenLoader(ByteTokenizer(), lambda e: iter([] if e else ["abc"]), seq_len=2, local_batch_size=1)
    loader.next_batch()  # epoch 0 holds 5 tokens: one window of 3
    with pytest.raises(ValueError, match="no documents in epoch 1"):
        loader.next_batch()


def test_loader_uses_hf_tokenizer_per_document(tmp_path):
    make_hf_folder(tmp_path / "tok", config={"bos_token": "<s>", "eos_token": "</s>"})
    tok = build_tokenizer(str(tmp_path / "tok"))
    texts = ["hello world", "the quick brown fox", "tessera"]
    stream = [t for text in texts for t in [tok.bos_id] + tok.encode(text) + [tok.eos_id]]
    loader = TokenLoader(tok, lambda e: iter(texts), seq_len=4, local_batch_size=2)
    x, y = loader.next_batch()
    assert x.tolist() == [stream[0:4], stream[5:9]] and y.tolist() == [stream[1:5], stream[6:10]]


@pytest.mark.parametrize("dp, streams", [(2, 1), (4, 1), (2, 4), (4, 2), (3, 4)])
def test_dp_ranks_partition_the_single_rank_stream(dp, streams):
    docs = random_corpus(20)
    reference = batches(TokenLoader(ByteTokenizer(), docs, 7, 2 * dp, 0, 1, streams), 6)
    merged, per_rank, _ = dp_batches(docs, 7, 2, dp, 6, streams=streams)
    assert_same(merged, reference)
    assert not torch.equal(per_rank[0][0][0], per_rank[1][0][0])  # ranks see different samples


def test_streams_deal_documents_round_robin():
    """Sample i is window i // S of stream i % S; stream s packs documents s, s + S, ... across epochs."""
    texts = ["ab", "cde", "f", "ghij", "k"]
    loader = TokenLoader(ByteTokenizer(), lambda e: iter(texts), seq_len=3, local_batch_size=1, streams=3)
    docs = texts * 6  # the endless document sequence, epoch after epoch
    packed = [[t for d in docs[s::3] for t in [B, *d.encode(), E]] for s in range(3)]
    got = [loader.next_batch() for _ in range(12)]
    for i, (x, y) in enumerate(got):
        window = packed[i % 3][4 * (i // 3):4 * (i // 3) + 4]
        assert x[0].tolist() == window[:-1] and y[0].tolist() == window[1:], i


@pytest.mark.parametrize("dp, streams, share", [(2, 4, 1 / 2), (4, 4, 1 / 4), (4, 2, 1 / 2), (3, 4, 1), (8, 64, 1 / 8)])
def test_each_rank_tokenizes_only_its_share(dp, streams, share):
    corpus = [f"document {i:04d} " * 3 for i in range(4000)]  # 44 tokens each with BOS and EOS
    whole = TokenLoader(ByteTokenizer(), lambda e: iter(corpus), 32, 4 * dp, 0, 1, streams)
    batches(whole, 40)
    assert whole.documents_tokenized >= 40 * 4 * dp * 33 // 44  # the whole global stream's worth
    for rank in range(dp):
        loader = TokenLoader(ByteTokenizer(), lambda e: iter(corpus), 32, 4, rank, dp, streams)
        batches(loader, 40)
        # Up to one encode chunk of documents read ahead and tokenized together.
        assert abs(loader.documents_tokenized - share * whole.documents_tokenized) <= 64


@pytest.mark.parametrize("streams", [1, 3])
def test_resume_matches_uninterrupted_across_dp_degrees(streams):
    docs = random_corpus(10)  # ~150 tokens per epoch: the 10 steps below cross several epochs
    reference = batches(TokenLoader(ByteTokenizer(), docs, 7, 4, 0, 1, streams), 10)
    head, _, loaders = dp_batches(docs, 7, 2, 2, 4, streams=streams)
    assert_same(head, reference[:4])
    states = [loader.state_dict() for loader in loaders]
    assert states == [{"sample_index": 16, "streams": streams}] * 2
    for local, dp in [(2, 2), (4, 1), (1, 4)]:
        tail, _, _ = dp_batches(docs, 7, local, dp, 6, state=states[0], streams=streams)
        assert_same(tail, reference[4:])


def test_resume_at_a_position_off_the_new_dp_grid():
    """After 5 samples on 1 rank, rank 0 of 2 draws from the odd streams: it must know it does."""
    docs = random_corpus(10)
    reference = torch.cat([x for x, _ in batches(TokenLoader(ByteTokenizer(), docs, 7, 1, 0, 1, 4), 21)])
    first = TokenLoader(ByteTokenizer(), docs, 7, 5, 0, 1, 4)
    first.next_batch()
    tail, _, _ = dp_batches(docs, 7, 2, 2, 4, state=first.state_dict(), streams=4)
    assert torch.equal(torch.cat([x for x, _ in tail]), reference[5:21])


def test_resume_replay_holds_little_text():
    """Replaying to a far position tokenizes (and drops) each stream's documents as they arrive, instead of
    keeping the replayed text of every stream but the one being read."""
    loader = TokenLoader(ByteTokenizer(), random_corpus(10), 7, 1, streams=8)
    loader.load_state_dict({"sample_index": 20_000, "streams": 8})
    loader.next_batch()
    assert loader._next_doc > 10_000
    assert max(len(st.texts) for st in loader._stream.values()) <= 2 * 64


def test_resume_refuses_another_stream_count():
    loader = TokenLoader(ByteTokenizer(), random_corpus(10), 7, 2, streams=4)
    with pytest.raises(ConfigError, match="training.data_streams is 4 but the checkpoint's data was dealt to 2 "
                                          "streams; set --training.data_streams 2"):
        loader.load_state_dict({"sample_index": 8, "streams": 2})


def test_build_dataloader_from_config():
    cfg = JobConfig()
    cfg.training.seq_len, cfg.training.local_batch_size = 16, 2
    loaders = [build_dataloader(cfg, ByteTokenizer(), rank, 2) for rank in range(2)]
    assert loaders[0].streams == cfg.training.data_streams == 64
    x0, _ = loaders[0].next_batch()
    x1, _ = loaders[1].next_batch()
    single = build_dataloader(cfg, ByteTokenizer(), 0, 1)
    assert torch.equal(torch.cat([single.next_batch()[0], single.next_batch()[0]]), interleave([x0, x1]))
    first_doc = next(documents("stdlib", "", "text", "train", 0, 0))
    assert x0[0].tolist() == [B] + list(first_doc.encode()[:15])


# --- sources: files ---------------------------------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path):
    """doc 0..119 in a.jsonl, 120..239 in b/c.parquet, 240 in b/d.txt, 241..242 in e.json; plus a stray .csv."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a.jsonl").write_text("".join(json.dumps({"id": k, "text": f"doc {k}"}) + "\n" for k in range(120)))
    table = pa.table({"id": list(range(120, 240)), "text": [f"doc {k}" for k in range(120, 240)]})
    pq.write_table(table, root / "b" / "c.parquet", row_group_size=25)
    (root / "b" / "d.txt").write_text("doc 240")
    (root / "e.json").write_text('{"text": "doc 241"}\n\n{"text": "doc 242"}\n')
    (root / "stray.csv").write_text("text\nnot a doc\n")
    return root


def file_docs(path, split, text_field="text"):
    return list(documents("files", str(path), text_field, split, 0, 0))


def test_files_folder_split(corpus):
    train, val = file_docs(corpus, "train"), file_docs(corpus, "validation")
    expected = [f"doc {k}" for k in range(243)]  # sorted paths: a.jsonl, b/c.parquet, b/d.txt, e.json
    assert val == [expected[99], expected[199]] == ["doc 99", "doc 199"]
    assert train == [d for i, d in enumerate(expected) if i % 100 != 99]
    assert set(train).isdisjoint(val)


def test_files_single_file_and_glob(corpus):
    assert file_docs(corpus / "b" / "d.txt", "train") == ["doc 240"]
    single = file_docs(corpus / "a.jsonl", "train")
    assert len(single) == 119 and "doc 99" not in single
    assert file_docs(corpus / "a.jsonl", "validation") == ["doc 99"]
    parquet = file_docs(str(corpus / "**" / "*.parquet"), "train")
    assert parquet == [f"doc {k}" for k in range(120, 240) if k != 219]
    assert file_docs(str(corpus / "*.json*"), "train") == [f"doc {k}" for k in range(120)
                                                         if k != 99] + ["doc 241", "doc 242"]


def test_files_missing_text_field(corpus):
    for path in (corpus / "a.jsonl", corpus / "b" / "c.parquet"):
        with pytest.raises(ValueError) as info:
            file_docs(path, "train", text_field="content")
        message = str(info.value)
        assert str(path) in message and "'content'" in message and "id" in message and "\n" not in message


def test_files_nothing_found(tmp_path):
    with pytest.raises(DataError, match="no .txt"):
        file_docs(tmp_path / "*.txt", "train")


# --- sources: stdlib and hub ------------------------------------------------------------------------------

def test_stdlib_corpus_split_and_shuffle():
    train = list(documents("stdlib", "", "text", "train", 0, 0))
    val = list(documents("stdlib", "", "text", "validation", 0, 0))
    assert 0 < len(val) < len(train) // 10
    everything = [f.read_text(encoding="utf-8", errors="replace") for f, _ in _stdlib_files()]
    assert Counter(train) + Counter(val) == Counter(t for t in everything if t.strip())  # each file in one split
    assert train == list(documents("stdlib", "", "text", "train", 0, 0))
    reseeded = list(documents("stdlib", "", "text", "train", 1, 0))
    next_epoch = list(documents("stdlib", "", "text", "train", 0, 1))
    assert reseeded != train and next_epoch != train and sorted(reseeded) == sorted(train)
    assert val == list(documents("stdlib", "", "text", "validation", 5, 3))


@pytest.fixture
def hub_offline(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both libraries read the variables once at import, which may have happened before this test.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("dataset, shown", [("c4", "allenai/c4"), ("someorg/somecorpus", "someorg/somecorpus")])
def test_hub_dataset_offline_message(hub_offline, dataset, shown):
    with pytest.raises(DataError) as info:
        documents(dataset, "", "text", "train", 0, 0)
    message = str(info.value)
    assert shown in message and "offline" in message and "stdlib" in message and "\n" not in message


def test_hub_dataset_local_copy(hub_offline, tmp_path):
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "train.jsonl").write_text('{"text": "x"}\n{"text": "y"}\n')
    assert sorted(documents("c4", str(tmp_path / "copy"), "text", "train", 0, 0)) == ["x", "y"]


# --- bad data: skipped and counted with file and line, or refused before training ---------------------------------

def test_bad_records_are_skipped_counted_and_limited(tmp_path):
    good = [json.dumps({"text": f"doc {k}"}) for k in range(6)]
    lines = [good[0], '{"text": "cut off', good[1], '{"text": 7}', '"a bare string"', good[2], '{"text": ["a"]}',
             good[3], '{"text": null}', '{"id": 1}', good[4]]
    data = tmp_path / "d.jsonl"
    data.write_bytes("\n".join(lines).encode() + b'\n{"text": "caf\xe9"}\n' + good[5].encode() + b"\n")
    bad = BadRecords(-1, quiet=True)
    docs = list(documents("files", str(data), "text", "train", 0, 0, bad=bad))
    assert docs == [f"doc {k}" for k in range(6)]
    assert bad.count == 7 and bad.first == f"{data}:2: not valid JSON (Invalid control character at column 18)"
    reasons = {}
    for limit in (7, 6):
        try:
            list(documents("files", str(data), "text", "train", 0, 0, bad=BadRecords(limit, quiet=True)))
        except DataError as e:
            reasons[limit] = str(e)
    assert 7 not in reasons  # exactly at the limit: the run goes on
    assert reasons[6] == (f"training.max_bad_records: 7 bad data records, more than 6; the latest, {data} line 12: "
                          f"bytes that are not UTF-8 (invalid continuation byte at column 14); fix the "
                          f"data, or raise training.max_bad_records (-1: no limit)")
    # Each reason names what is wrong; a second epoch counts nothing twice.
    messages = []
    bad = BadRecords(-1)
    bad.quiet, bad.skip = True, lambda file, where, reason: messages.append(f"{where}: {reason}")
    list(documents("files", str(data), "text", "train", 0, 0, bad=bad))
    assert messages[1:] == ["line 4: 'text' is a number, not a string",
                            "line 5: a string (JSON), not an object with a 'text' field",
                            "line 7: 'text' is an array, not a string", "line 9: 'text' is null, not a string",
                            "line 10: no field 'text'",
                            "line 12: bytes that are not UTF-8 (invalid continuation byte at column 14)"]
    twice = BadRecords(-1, quiet=True)
    for epoch in (0, 1):
        list(documents("files", str(data), "text", "train", 0, epoch, bad=twice))
    assert twice.count == 7
    # By default (no counter) the first bad record stops, naming file and line.
    with pytest.raises(DataError, match=rf"more than 0; the latest, {data} line 2: not valid JSON"):
        list(documents("files", str(data), "text", "train", 0, 0))


def test_bad_txt_and_parquet_records(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"fine\nline two \xff\xfe\n")
    pq.write_table(pa.table({"text": ["x", None, "y"]}), tmp_path / "b.parquet")
    bad = BadRecords(-1, quiet=True)
    assert list(documents("files", str(tmp_path), "text", "train", 0, 0, bad=bad)) == ["x", "y"]
    assert bad.count == 2 and bad.first.startswith(f"{tmp_path / 'a.txt'}:2: bytes that are not UTF-8")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: column 'text' \(training.dataset_text_field\) holds int64"):
        list(documents("files", str(tmp_path / "b.parquet"), "text", "train", 0, 0))


def test_empty_or_too_small_data_is_refused_before_training(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": "  "}\n\n')
    for name in ("empty.txt", "blank.jsonl"):
        with pytest.raises(DataError, match=rf"training.dataset_path: no text in {tmp_path / name}: every document "
                                            rf"is empty$"):
            check_files(str(tmp_path / name), "text", validation=False)
    (tmp_path / "junk.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match=r"training.dataset_path: no document in .*junk.jsonl: its records are all bad "
                                        r"or empty \(1 bad; the first: .*junk.jsonl:1: not valid JSON \(Expecting "
                                        r"value at column 1\)\); write one JSON object per line \(.jsonl\), or one "
                                        r"JSON array of objects \(.json\), each with its text in the string field "
                                        r"'text'$"):
        check_files(str(tmp_path / "junk.jsonl"), "text", validation=False)
    (tmp_path / "small.txt").write_text("one document")
    check_files(str(tmp_path / "small.txt"), "text", validation=False)
    with pytest.raises(DataError, match=r"validation.enable: the validation split of .*small.txt is empty"):
        check_files(str(tmp_path / "small.txt"), "text", validation=True)
    (tmp_path / "many.jsonl").write_text("".join(json.dumps({"text": f"d{k}"}) + "\n" for k in range(100)))
    check_files(str(tmp_path / "many.jsonl"), "text", validation=True)
