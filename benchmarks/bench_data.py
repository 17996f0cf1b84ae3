"""Data loading at growing DP degree: what one rank's loader costs, with documents dealt to streams or not.

    python benchmarks/bench_data.py [--seq_len 2048] [--local_batch_size 4] [--warmup 16] [--steps 32]
        [--degrees 1,2,4,8] [--vocab 8192] [--out benchmarks/results/data.json]

A BPE tokenizer (Hugging Face `tokenizers`, byte level) is trained on the built-in corpus first, so tokenizing
costs what a real one does. For each DP degree D, rank 0's loader hands out `--warmup` untimed batches, then
`--steps` timed ones, with
`training.data_streams` 64 (rank 0 tokenizes the documents of its own streams only) and with 1 (one stream:
every rank tokenizes every document, as a single global packing forces). The two runs of a degree alternate
step by step. The stream count does not change what a rank is given per step, only what it must tokenize.
Documents are the built-in corpus cut at blank lines, about the size of web documents. Each stream starts by
tokenizing a whole document of which its first window may use part: a one-off cost of up to 64 documents
with 64 streams, which the untimed warm-up absorbs.
"""

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, smoke_option, write_json  # noqa: E402, I001
from tessera.data import TokenLoader, build_tokenizer, documents  # noqa: E402


def train_tokenizer(folder: Path, vocab: int, n_docs: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    docs = documents("stdlib", "", "text", "train", 0, 0)
    tok.train_from_iterator((text for _, text in zip(range(n_docs), docs, strict=False)), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def paragraphs(split: str, seed: int, epoch: int) -> Iterator[str]:
    """The built-in corpus cut at blank lines: documents of about web-page size (c4's run to a few hundred tokens)
    rather than whole source files."""
    for text in documents("stdlib", "", "text", split, seed, epoch):
        yield from (part for part in text.split("\n\n") if part.strip())


# --smoke (this and bench_prepared.py): short windows, a small vocabulary, few batches
SMOKE = dict(seq_len=128, local_batch_size=2, warmup=1, steps=2, degrees="1,2", vocab=512, train_docs=20)


def loader_options(doc: str, warmup: int, steps: int, degrees: str) -> argparse.ArgumentParser:
    """The options the data benchmarks share (this one and bench_prepared.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--local_batch_size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=warmup, help="untimed batches per loader first")
    p.add_argument("--steps", type=int, default=steps, help="timed batches per loader")
    p.add_argument("--degrees", default=degrees, help="DP degrees; rank 0 of each is measured")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained on the built-in corpus")
    p.add_argument("--train_docs", type=int, default=300, help="documents the tokenizer is trained on")
    return p


def main() -> None:
    p = loader_options(__doc__, 16, 32, "1,2,4,8")
    p.add_argument("--out", default=str(RESULTS / "data.json"))
    smoke_option(p, **SMOKE)
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        train_tokenizer(Path(folder), a.vocab, a.train_docs)
        tokenizer = build_tokenizer(folder)
        print(f"BPE tokenizer, vocab {tokenizer.vocab_size}, trained in {time.perf_counter() - start:.1f}s")
    corpus = functools.partial(paragraphs, "train", 0)
    res = {"seq_len": a.seq_len, "local_batch_size": a.local_batch_size, "warmup": a.warmup, "steps": a.steps,
           "results": []}
    print(f"rank 0, seq {a.seq_len} x batch {a.local_batch_size}, {a.steps} timed batches per loader after "
          f"{a.warmup}")
    print(f" DP  {'ms/batch 64 streams':>20} {'1 stream':>10} {'ratio':>7}  {'docs tokenized (timed) 64 / 1':>30}")
    for degree in map(int, a.degrees.split(",")):
        loaders = {n: TokenLoader(tokenizer, corpus, a.seq_len, a.local_batch_size, 0, degree, n) for n in (64, 1)}
        seconds, docs_before = {n: [] for n in loaders}, {}
        for step in range(a.warmup + a.steps):
            for n, loader in loaders.items():
                if step == a.warmup:
                    docs_before[n] = loader.documents_tokenized
                start = time.perf_counter()
                loader.next_batch()
                if step >= a.warmup:
                    seconds[n].append(time.perf_counter() - start)
        docs = {n: loader.documents_tokenized - docs_before[n] for n, loader in loaders.items()}
        # The mean, not the median: a loader pays for tokenizing in bursts (a chunk of documents at a time).
        ms = {n: 1e3 * statistics.fmean(s) for n, s in seconds.items()}
        row = {"dp": degree, "ms_per_batch_64_streams": ms[64], "ms_per_batch_1_stream": ms[1],
               "ratio": ms[64] / ms[1], "docs_tokenized_64_streams": docs[64], "docs_tokenized_1_stream": docs[1]}
        res["results"].append(row)
        print(f" {degree:>2}  {ms[64]:>20.1f} {ms[1]:>10.1f} {row['ratio']:>7.2f}  {docs[64]:>18} / {docs[1]:<10}")
    print("ratio: 64 streams / 1 stream; expect about 1/DP, as a rank tokenizes 1/DP of the documents")
    write_json(a.out, res)


if __name__ == "__main__":
    main()
