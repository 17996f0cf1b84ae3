"""Prepared (pre-tokenized, memory-mapped) data against the streaming loader, side by side in one run.

    python benchmarks/bench_prepared.py [--seq_len 2048] [--local_batch_size 4] [--warmup 4] [--steps 16]
        [--degrees 1,8,64] [--vocab 8192] [--workers 1,2] [--out benchmarks/results/prepared.json]

The built-in corpus, cut at blank lines (documents of web-page size, as bench_data.py), is written to a .jsonl
and a byte-level BPE tokenizer is trained on it. Then:

1. `prepare`: `python -m tessera.data.prepare` on that file, once per --workers count, into a fresh folder each:
   tokens/s, tokens/s per worker (each worker is one process; the tokenizer's own threads are off), and tokens per
   CPU-second of the tasks (what a core does, whatever else the machine runs meanwhile).
2. The loaders: for each DP degree D (ranks simulated: rank 0 of D is measured), the streaming TokenLoader
   (`training.dataset = files` on the .jsonl, 64 streams) and the PreparedLoader on the prepared folder hand out
   --warmup untimed batches and --steps timed ones, alternating batch by batch. Reported per step: rank 0's loader
   time, and the bytes it read: the streaming loader reads the text of every document (each rank reads them all,
   tokenizing its streams' share), the prepared one the tokens of its own windows.
"""

import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import SMOKE, loader_options, paragraphs, train_tokenizer  # noqa: E402, I001
from common import RESULTS, smoke_option, write_json  # noqa: E402
from tessera.data import TokenLoader, build_tokenizer, documents, prepare  # noqa: E402
from tessera.data.prepared import build_prepared_loader  # noqa: E402
from tessera.schema import parse_args  # noqa: E402


class Counted:
    """The streaming loader's documents, counting the bytes of text it reads."""

    def __init__(self, path: str):
        self.path, self.bytes_read = path, 0

    def __call__(self, epoch: int):
        for text in documents("files", self.path, "text", "train", 0, epoch):
            self.bytes_read += len(text.encode("utf-8"))
            yield text


def timed_prepare(corpus: Path, out: Path, tokenizer: str, workers: int, pieces: int) -> dict:
    start = time.perf_counter()
    size_mb = corpus.stat().st_size / 2 ** 20
    argv = ["--input", str(corpus), "--output", str(out), "--tokenizer", tokenizer, "--workers", str(workers),
            "--piece_mb", f"{size_mb / pieces:.4f}", "--tasks", str(pieces)]
    assert prepare.main(argv) == 0
    seconds = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    cpu = sum(json.loads(f.read_text())["cpu_seconds"] for f in (out / ".prepare" / "tasks").glob("*.json"))
    return {"workers": workers, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_worker": tokens / seconds / workers, "task_cpu_seconds": cpu,
            "tokens_per_cpu_second": tokens / cpu}


def ratio(num: float, den: float) -> float:
    """num / den, NaN when nothing was read (a short run whose documents were all read before the timed steps)."""
    return num / den if den else float("nan")


def measure(loaders: dict, counters: dict, warmup: int, steps: int) -> tuple[dict, dict]:
    """Mean ms per next_batch and MiB read per step of each loader, taking turns batch by batch; `counters[name]`
    has the bytes that loader read so far in .bytes_read."""
    def read(name: str) -> int:
        return counters[name].bytes_read

    seconds, before = {n: [] for n in loaders}, {}
    for step in range(warmup + steps):
        for name, loader in loaders.items():
            if step == warmup:
                before[name] = read(name)
            start = time.perf_counter()
            loader.next_batch()
            if step >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return ({n: 1e3 * statistics.fmean(s) for n, s in seconds.items()},
            {n: (read(n) - before[n]) / steps / 2 ** 20 for n in loaders})


def main() -> None:
    p = loader_options(__doc__, 4, 16, "1,8,64")
    p.add_argument("--workers", default="1,2", help="prepare runs, one per worker count")
    p.add_argument("--corpus_docs", type=int, default=0, help="documents of the corpus written (0: all)")
    p.add_argument("--out", default=str(RESULTS / "prepared.json"))
    smoke_option(p, **SMOKE | {"degrees": "1,8", "workers": "1", "corpus_docs": 200})
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_tokenizer(tmp, a.vocab, a.train_docs)
        corpus = tmp / "corpus.jsonl"
        with open(corpus, "w") as fh:
            for text in itertools.islice(paragraphs("train", 0, 0), a.corpus_docs or None):
                fh.write(json.dumps({"text": text}) + "\n")
        print(f"corpus: {corpus.stat().st_size / 2 ** 20:.1f} MiB of .jsonl; BPE vocab "
              f"{build_tokenizer(str(tmp)).vocab_size}")
        res = {"seq_len": a.seq_len, "local_batch_size": a.local_batch_size, "steps": a.steps, "prepare": [],
               "loaders": []}
        pieces = 4 * max(map(int, a.workers.split(",")))
        for workers in map(int, a.workers.split(",")):
            row = timed_prepare(corpus, tmp / f"prepared_{workers}", str(tmp), workers, pieces)
            res["prepare"].append(row)
        print(f"\nprepare ({pieces} tasks): {'workers':>8} {'tokens/s':>12} {'per worker':>12} "
              f"{'per task CPU-s':>15} {'seconds':>8}")
        for row in res["prepare"]:
            print(f"{'':21}{row['workers']:>8} {row['tokens_per_s']:>12,.0f} {row['tokens_per_s_per_worker']:>12,.0f}"
                  f" {row['tokens_per_cpu_second']:>15,.0f} {row['seconds']:>8.1f}")

        folder = str(tmp / f"prepared_{res['prepare'][0]['workers']}")
        tokenizer = build_tokenizer(str(tmp))
        print(f"\nrank 0 of DP ranks, seq {a.seq_len} x batch {a.local_batch_size}, {a.steps} timed steps after "
              f"{a.warmup}")
        print(f" {'DP':>3} {'ms/step streaming':>18} {'prepared':>9} {'ratio':>7}   {'MiB read/step streaming':>24} "
              f"{'prepared':>9} {'ratio':>7}")
        for degree in map(int, a.degrees.split(",")):
            docs = Counted(str(corpus))
            cfg = parse_args(["--training.dataset", "tokenized", "--training.dataset_path", folder,
                              "--training.seq_len", str(a.seq_len), "--training.local_batch_size",
                              str(a.local_batch_size), "--model.hf_assets_path", str(tmp)])
            loaders = {"streaming": TokenLoader(tokenizer, docs, a.seq_len, a.local_batch_size, 0, degree, 64),
                       "prepared": build_prepared_loader(cfg, tokenizer, 0, degree)}
            ms, mib = measure(loaders, {"streaming": docs, "prepared": loaders["prepared"]}, a.warmup, a.steps)
            row = {"dp": degree, "ms_per_step_streaming": ms["streaming"], "ms_per_step_prepared": ms["prepared"],
                   "mib_read_per_step_streaming": mib["streaming"], "mib_read_per_step_prepared": mib["prepared"]}
            res["loaders"].append(row)
            print(f" {degree:>3} {ms['streaming']:>18.2f} {ms['prepared']:>9.2f} "
                  f"{ms['prepared'] / ms['streaming']:>7.3f}   {mib['streaming']:>24.2f} {mib['prepared']:>9.3f} "
                  f"{ratio(mib['prepared'], mib['streaming']):>7.4f}")
    print("ratio: prepared / streaming. A prepared rank reads local_batch_size x (seq_len + 1) tokens a step, "
          "whatever the DP degree")
    res["cpu_count"] = os.cpu_count()
    write_json(a.out, res)


if __name__ == "__main__":
    main()
