"""Tokenize a corpus once, offline, into the shards training memory-maps (tessera/data/tokens.py: the format).

    python -m tessera.data.prepare --input data/ --output prepared/web --tokenizer assets/hf/Llama-3.1-8B
    python -m tessera.data.prepare --input allenai/c4 --hub_config en --output prepared/c4 --tokenizer ...
    python -m tessera.data.prepare ... --slurm_partition cpu --tasks 2000     # on a SLURM cluster

The input is split into pieces (a .txt file or a .json array, whole; a .jsonl file (or a .json of JSON Lines) cut
into byte ranges of about --piece_mb at line starts; a .parquet file's row groups in groups of about that size; for
a Hub dataset, its stream shards), the pieces are dealt to --tasks tasks (largest first, each to the task with the
fewest bytes so far), and each task tokenizes its pieces in order into its own shards. datatrove's executors run the
tasks: LocalPipelineExecutor on the cores of this machine (--workers at a time), SlurmPipelineExecutor as a SLURM
job array. A task that finished is recorded and never run again, so an interrupted prepare resumes when the same
command runs again; the output depends only on the input, the tokenizer and --tasks / --piece_mb /
--validation_every / --shard_tokens (never on --workers or the machine). The manifest is written last, from the
tasks' summaries: until it exists the folder is not a prepared dataset. A document goes to the validation split when
the CRC-32 of its text is 0 modulo --validation_every (whatever file or task it is in; duplicates land on the same
side).
"""

import argparse
import glob
import heapq
import json
import os
import sys
import threading
import time
import zlib
from array import array
from pathlib import Path

import numpy as np

from tessera.config import ConfigError
from tessera.data.examples import encode_examples, piece_examples, prepared_format
from tessera.data.records import BadRecords, DataError, file_texts, is_json_array
from tessera.data.sources import FILE_SUFFIXES, HUB_ALIASES, _hub_texts, _resolve_files, check_hub
from tessera.data.tokenizer import build_tokenizer, encode_documents
from tessera.data.tokens import FORMAT, MANIFEST, SPLITS, VERSION, WORK, token_dtype, tokenizer_fingerprint

_CHUNK_DOCS, _CHUNK_CHARS = 512, 8 << 20  # documents tokenized per call: amortizes overhead, bounds memory
_IDENTITY = ("format", "version", "inputs", "sources", "tokenizer", "text_field", "validation_every", "tasks",
             "piece_bytes", "shard_tokens", "examples")  # what the output depends on: a resume must agree on all of it


class ShardWriter:
    """A task's shards of one split: documents appended in order, a new part once `shard_tokens` would be passed
    (documents are never cut). Each part is written under a temporary name and renamed when complete. `masked`:
    the documents mark their untrained tokens (~id); the ids go to .bin, a byte per token (1: trained) to .mask."""

    def __init__(self, root: Path, split: str, task: int, dtype: np.dtype, shard_tokens: int, masked: bool = False):
        self.root, self.split, self.task, self.dtype, self.shard_tokens = root, split, task, dtype, shard_tokens
        self.suffixes = (".bin", ".idx", ".mask") if masked else (".bin", ".idx")
        self.parts: list[dict] = []
        self._bin = None
        (root / split).mkdir(parents=True, exist_ok=True)

    def add(self, docs: list[np.ndarray]) -> None:
        group, pending = [], 0  # documents not written yet, and their tokens
        for doc in docs:
            if self._bin is None or (0 < self._offsets[-1] + pending and
                                     self._offsets[-1] + pending + len(doc) > self.shard_tokens):
                self._write(group)
                group, pending = [], 0
                self._open()
            group.append(doc)
            pending += len(doc)
        self._write(group)

    def _open(self) -> None:
        self.close()
        self._name = f"{self.split}/{self.task:05d}-{len(self.parts):04d}"
        self._bin = open(self.root / f"{self._name}.bin.tmp", "wb")
        self._mask = open(self.root / f"{self._name}.mask.tmp", "wb") if ".mask" in self.suffixes else None
        self._offsets = array("q", [0])

    def _write(self, group: list[np.ndarray]) -> None:
        if group:
            ids = np.concatenate(group)
            if self._mask is not None:
                self._mask.write((ids >= 0).astype(np.uint8).tobytes())
                ids = np.where(ids < 0, ~ids, ids)
            self._bin.write(ids.astype(self.dtype).tobytes())
            for doc in group:
                self._offsets.append(self._offsets[-1] + len(doc))

    def close(self) -> list[dict]:
        if self._bin is not None:
            self._bin.close()
            if self._mask is not None:
                self._mask.close()
            (self.root / f"{self._name}.idx.tmp").write_bytes(self._offsets.tobytes())
            for suffix in self.suffixes:
                os.replace(self.root / f"{self._name}{suffix}.tmp", self.root / f"{self._name}{suffix}")
            self.parts.append({"file": f"{self._name}.bin", "tokens": self._offsets[-1],
                               "documents": len(self._offsets) - 1})
            self._bin = None
        return self.parts


class PrepareTask:
    """One datatrove task: pieces[rank] tokenized into `output`, then a summary in .prepare/tasks/. Called as a
    pipeline step (data, rank, world_size)."""

    def __init__(self, output: str, request: dict, pieces: list[list[dict]], max_bad_records: int, quiet: bool):
        self.output, self.request, self.pieces, self.quiet = output, request, pieces, quiet
        self.max_bad_records = max_bad_records  # per task here; Finish checks the sum

    def __setstate__(self, state: dict) -> None:  # unpickled in a worker, before datatrove logs anything there
        self.__dict__.update(state)
        if self.quiet:
            from loguru import logger
            logger.disable("datatrove")

    def __call__(self, data, rank: int = 0, world_size: int = 1):
        # One task per core: the tokenizer's own thread pool would only contend with the other tasks.
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            self._run(rank, world_size)
        finally:
            if before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM")
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before

    def _run(self, rank: int, world_size: int) -> None:
        r, root, cpu = self.request, Path(self.output), time.process_time()
        tokenizer = build_tokenizer(r["tokenizer"]["path"])
        writers = {s: ShardWriter(root, s, rank, np.dtype(r["dtype"]), r["shard_tokens"], bool(r.get("examples")))
                   for s in SPLITS}
        fmt = prepared_format(r.get("examples"), r["tokenizer"]["path"])
        bad = BadRecords(self.max_bad_records, option="--max_bad_records")
        progress = _Progress(root / WORK / "progress" / f"{rank:05d}")
        read = 0
        for piece in self.pieces[rank]:
            texts, chars, seen = [], 0, 0
            items = _piece_texts(piece, r, bad, rank, world_size) if fmt is None else \
                piece_examples(fmt, Path(piece["path"]), bad, piece["start"], piece["end"])
            for text in items:
                if text is not None:
                    texts.append(text)
                    chars += len(text if fmt is None else text.text)
                if len(texts) >= _CHUNK_DOCS or chars >= _CHUNK_CHARS:
                    self._tokenize(texts, tokenizer, writers)
                    seen += chars if piece["kind"] == "file" else len(texts)  # characters: about the bytes
                    read, texts, chars = read + len(texts), [], 0
                    progress.set(progress.base + min(piece["size"] - 1, seen))
            self._tokenize(texts, tokenizer, writers)
            read += len(texts)
            progress.base += piece["size"]
            progress.set(progress.base, force=True)
        summary = {"task": rank, "documents_read": read, "bad_records": bad.count, "first_bad": bad.first,
                   "splits": {s: w.close() for s, w in writers.items()}, "cpu_seconds": time.process_time() - cpu}
        _write_json(root / WORK / "tasks" / f"{rank:05d}.json", summary)

    def _tokenize(self, texts: list[str], tokenizer, writers: dict[str, ShardWriter]) -> None:
        if not texts:
            return
        every, plain = self.request["validation_every"], isinstance(texts[0], str)  # else chat.Rendered examples
        held = [bool(every) and zlib.crc32((t if plain else t.text).encode("utf-8", "surrogatepass")) % every == 0
                for t in texts]
        docs = encode_documents(tokenizer, texts) if plain else encode_examples(tokenizer, texts)
        writers["train"].add([d for d, h in zip(docs, held, strict=True) if not h])
        writers["validation"].add([d for d, h in zip(docs, held, strict=True) if h])


class _Progress:
    """A task's progress (its pieces' units done: bytes, or documents of a Hub stream) in a file, for the bar of
    the process that launched it."""

    def __init__(self, file: Path):
        self.file, self.base, self._last = file, 0, 0.0
        file.parent.mkdir(parents=True, exist_ok=True)

    def set(self, value: int, force: bool = False) -> None:
        if force or time.monotonic() - self._last > 0.5:
            self.file.write_text(str(value))
            self._last = time.monotonic()


def _piece_texts(piece: dict, request: dict, bad: BadRecords, rank: int, world_size: int):
    if piece["kind"] != "hub":
        yield from file_texts(Path(piece["path"]), request["text_field"], bad, piece["start"], piece["end"])
        return
    import datasets
    from datasets.distributed import split_dataset_by_node

    source = request["sources"][0]
    ds = datasets.load_dataset(source["hub"], source["config"], split=source["split"], streaming=True)
    yield from _hub_texts(split_dataset_by_node(ds, rank, world_size), request["text_field"], source["hub"])


# --- planning: inputs -> pieces -> tasks ----------------------------------------------------------------------

def plan_files(inputs: list[str], piece_bytes: int) -> tuple[list[dict], list[dict]]:
    """(sources, pieces) of local inputs: every file once, in the order given (each input's files sorted)."""
    files, seen = [], set()
    for path in inputs:
        for file in _resolve_files(path, key="--input"):
            if file.resolve() not in seen:
                seen.add(file.resolve())
                files.append(file)
    sources = [{"path": str(f), "bytes": f.stat().st_size, "mtime": int(f.stat().st_mtime)} for f in files]
    pieces = []
    for f, s in zip(files, sources, strict=True):
        if f.suffix == ".parquet":
            pieces += _parquet_pieces(f, piece_bytes)
            continue
        whole = f.suffix == ".txt" or is_json_array(f)  # an array's elements cannot be found from a byte offset
        n = 1 if whole else max(1, s["bytes"] // piece_bytes)
        bounds = [s["bytes"] * k // n for k in range(n + 1)]
        pieces += [{"kind": "file", "path": str(f), "start": a, "end": b if n > 1 else None, "size": b - a}
                   for a, b in zip(bounds, bounds[1:], strict=False)]
    return sources, pieces


def _parquet_pieces(file: Path, piece_bytes: int) -> list[dict]:
    import pyarrow.parquet as pq

    meta, pieces, first, size = pq.ParquetFile(file).metadata, [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= piece_bytes or g == meta.num_row_groups - 1:
            pieces.append({"kind": "file", "path": str(file), "start": first, "end": g + 1, "size": max(size, 1)})
            first, size = g + 1, 0
    return pieces


def deal(pieces: list[dict], tasks: int) -> list[list[dict]]:
    """Pieces to tasks, largest first, each to the task with the fewest bytes (ties: the lowest task); a task keeps
    its pieces in input order. Deterministic."""
    load, dealt = [(0, t) for t in range(tasks)], [[] for _ in range(tasks)]  # a heap of (bytes, task)
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i]["size"], i)):
        size, t = heapq.heappop(load)
        heapq.heappush(load, (size + pieces[i]["size"], t))
        dealt[t].append(i)
    return [[pieces[i] for i in sorted(mine)] for mine in dealt]


def plan_hub(name: str, config: str | None, split: str) -> tuple[list[dict], int, int]:
    """(sources, stream shards, examples or 0 when unknown) of a Hub dataset; fails fast when offline."""
    check_hub(name, "")
    import datasets

    hub, default_config = HUB_ALIASES.get(name, (name, None))
    config = config or default_config
    try:
        ds = datasets.load_dataset(hub, config, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - network, auth and cache failures all arrive as different types
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"--input: could not load {hub!r} from the Hugging Face Hub: {detail}") from e
    info = (ds.info.splits or {}).get(split) if ds.info else None
    return [{"hub": hub, "config": config, "split": split}], ds.num_shards, getattr(info, "num_examples", 0) or 0


# --- the request, the output folder, the run ------------------------------------------------------------------

def build_request(a: argparse.Namespace) -> tuple[dict, list[list[dict]], int]:
    """(request, pieces per task, total progress units) from the command line; DataError when the input is bad."""
    tokenizer_path = str(Path(a.tokenizer).parent) if a.tokenizer.endswith("tokenizer.json") else a.tokenizer
    try:
        tokenizer = build_tokenizer(tokenizer_path)
    except ConfigError as e:
        raise DataError(str(e).replace("model.hf_assets_path", "--tokenizer")) from None
    inputs = [i for arg in a.input for i in arg.split(",") if i]
    hub = len(inputs) == 1 and not (os.path.exists(inputs[0]) or glob.glob(inputs[0])) and \
        (inputs[0] in HUB_ALIASES or (inputs[0].count("/") == 1 and not inputs[0].startswith((".", "/"))
                                      and Path(inputs[0]).suffix not in FILE_SUFFIXES))
    if hub:
        sources, shards, examples = plan_hub(inputs[0], a.hub_config or None, a.hub_split)
        tasks = a.tasks or min(shards, 1024)
        pieces = [[{"kind": "hub", "size": max(1, examples // tasks)}] for _ in range(tasks)]
    else:
        sources, flat = plan_files(inputs, int(a.piece_mb * 2 ** 20))
        tasks = a.tasks or min(len(flat), 1024)
        pieces = deal(flat, tasks)
    request = {"format": FORMAT, "version": VERSION, "inputs": inputs, "sources": sources,
               "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer_path), "vocab_size": tokenizer.vocab_size,
                             "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
                             "path": os.path.abspath(tokenizer_path) if tokenizer_path else ""},
               "dtype": token_dtype(tokenizer.vocab_size).name, "text_field": a.text_field,
               "validation_every": a.validation_every, "tasks": tasks, "piece_bytes": int(a.piece_mb * 2 ** 20),
               "shard_tokens": a.shard_tokens, "examples": None if a.format == "text" else {
                   "kind": a.format, "messages_field": a.messages_field, "chat_template": a.chat_template,
                   "assistant_only": not a.all_tokens}}
    if hub and a.format != "text":
        raise DataError(f"--format {a.format}: prepares local files; for a Hub dataset, save it as .jsonl or .parquet "
                        f"first (or train on it streamed, training.dataset_format = {a.format!r})")
    if a.format != "text":
        prepared_format(request["examples"], tokenizer_path)  # the template compiles
    return request, pieces, sum(p["size"] for task in pieces for p in task)


def _identity(request: dict) -> dict:
    return {k: request.get(k) if k != "tokenizer" else {**request[k], "path": None} for k in _IDENTITY}


def claim_output(output: Path, request: dict) -> bool:
    """The output folder is new, empty, or this request's own earlier (maybe interrupted) prepare: then it is
    claimed and True returned, or False when it is complete already. Anything else is refused, untouched."""
    saved = output / WORK / "request.json"
    if saved.is_file():
        old = json.loads(saved.read_text())
        differ = [k for k in _IDENTITY if _identity(old).get(k) != _identity(request)[k]]
        if differ:
            raise DataError(f"--output: {output} holds a prepare of other settings (they differ in: "
                            f"{', '.join(differ)}); name another --output, or delete {output} to prepare anew")
        return not (output / MANIFEST).is_file()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DataError(f"--output: {output} is {'not empty' if output.is_dir() else 'a file'} and is not a "
                        f"prepare's output; name a new or empty folder (nothing was written)")
    _write_json(saved, request)
    return True


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Finish:
    """The manifest from the tasks' summaries (a datatrove step too: a SLURM job after the tasks' array)."""

    def __init__(self, output: str, max_bad_records: int):
        self.output, self.max_bad_records = output, max_bad_records

    def __call__(self, data=None, rank: int = 0, world_size: int = 1) -> None:
        self.manifest()

    def manifest(self) -> dict:
        root = Path(self.output)
        request = json.loads((root / WORK / "request.json").read_text())
        summaries = []
        for task in range(request["tasks"]):
            file = root / WORK / "tasks" / f"{task:05d}.json"
            if not file.is_file():
                raise DataError(f"--output: task {task} of {root} has not finished; run the prepare command again")
            summaries.append(json.loads(file.read_text()))
        bad = sum(s["bad_records"] for s in summaries)
        first = next((s["first_bad"] for s in summaries if s["first_bad"]), None)
        if self.max_bad_records != -1 and bad > self.max_bad_records:
            raise DataError(f"--max_bad_records: {bad} bad records, more than {self.max_bad_records}; the first, "
                            f"{first}; fix the data, or rerun with a higher --max_bad_records (-1: no limit)")
        splits = {}
        for split in SPLITS:
            shards = [part for s in summaries for part in s["splits"][split]]
            splits[split] = {"tokens": sum(p["tokens"] for p in shards),
                             "documents": sum(p["documents"] for p in shards), "shards": shards}
        if not splits["train"]["tokens"]:
            raise DataError(f"--input: no text in {', '.join(request['inputs'])}: every document is empty or bad "
                            f"({bad} bad record(s){f', the first {first}' if first else ''})")
        manifest = {**{k: request.get(k) for k in _IDENTITY if k not in ("format", "version")}, "format": FORMAT,
                    "version": VERSION, "dtype": request["dtype"], "splits": splits,
                    "bad_records": {"count": bad, "first": first}}
        _write_json(root / MANIFEST, manifest)
        return manifest


def run_local(output: Path, request: dict, pieces: list[list[dict]], total: int, a: argparse.Namespace) -> int:
    """The tasks on this machine's cores, a progress bar (bytes of input, ETA) meanwhile."""
    from datatrove.executor import LocalPipelineExecutor
    from loguru import logger
    from tqdm import tqdm

    logger.disable("datatrove")
    workers = max(1, min(a.workers or os.cpu_count() or 1, request["tasks"]))
    task = PrepareTask(str(output), request, pieces, a.max_bad_records, quiet=True)
    executor = LocalPipelineExecutor([task], tasks=request["tasks"], workers=workers,
                                     logging_dir=str(output / WORK / "executor"))
    done = threading.Event()

    def measured() -> int:
        finished = {int(f) for f in _listdir(output / WORK / "executor" / "completions")}
        return sum(sum(p["size"] for p in pieces[t]) if t in finished else _read_int(output / WORK / "progress" /
                                                                                      f"{t:05d}")
                   for t in range(request["tasks"]))

    def show() -> None:
        with tqdm(total=total, initial=measured(), unit="B" if pieces[0][0]["kind"] == "file" else " docs",
                  unit_scale=True, desc=f"prepare {output.name}", dynamic_ncols=True) as bar:
            while not done.wait(0.5):
                bar.update(measured() - bar.n)
            bar.update(measured() - bar.n)

    bar = threading.Thread(target=show, daemon=True)
    bar.start()
    try:
        executor.run()
    finally:
        done.set()
        bar.join()
    return workers


def run_slurm(output: Path, request: dict, pieces: list[list[dict]], a: argparse.Namespace) -> None:
    """A SLURM job array of the tasks and, after it, a job that writes the manifest."""
    from datatrove.executor import SlurmPipelineExecutor

    env = a.slurm_env_command or (f"source {sys.prefix}/bin/activate; export PYTHONPATH="
                                  f"{Path(__file__).resolve().parents[2]}${{PYTHONPATH:+:$PYTHONPATH}}")
    common = {"time": a.slurm_time, "partition": a.slurm_partition, "env_command": env, "mem_per_cpu_gb":
              a.slurm_mem_per_cpu_gb, "job_name": f"prepare_{output.name}"}
    task = PrepareTask(str(output), request, pieces, a.max_bad_records, quiet=False)
    tasks = SlurmPipelineExecutor([task], tasks=request["tasks"], workers=a.workers or -1,
                                  logging_dir=str(output / WORK / "executor"), **common)
    finish = SlurmPipelineExecutor([Finish(str(output), a.max_bad_records)], tasks=1, depends=tasks,
                                   logging_dir=str(output / WORK / "finish"), **common)
    finish.run()


def _listdir(folder: Path) -> list[str]:
    return os.listdir(folder) if folder.is_dir() else []


def _read_int(file: Path) -> int:
    try:
        return int(file.read_text() or 0)
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tessera.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", action="append", required=True,
                   help="file, folder or glob of .txt/.jsonl/.parquet (repeat it, or comma-separate), or a Hub "
                        "dataset ORG/NAME (or c4)")
    p.add_argument("--output", required=True, help="folder to write: new, empty, or this command's earlier output")
    p.add_argument("--tokenizer", default="", help="folder holding tokenizer.json (+ tokenizer_config.json), as "
                   "model.hf_assets_path; empty: the built-in byte tokenizer")
    p.add_argument("--text_field", default="text", help="field holding the text in jsonl/parquet/Hub rows")
    p.add_argument("--format", default="text", choices=("text", "chat", "prompt_completion"),
                   help="as training.dataset_format: chat and prompt_completion store a loss mask beside the tokens")
    p.add_argument("--messages_field", default="messages", help="chat: the field holding the messages")
    p.add_argument("--chat_template", default="auto", choices=("auto", "plain"), help="as training.chat_template")
    p.add_argument("--all_tokens", action="store_true", help="train every token (training.assistant_only_loss = "
                   "false); default: the assistant turns / the completion only")
    p.add_argument("--hub_config", default="", help="Hub dataset config (c4: en)")
    p.add_argument("--hub_split", default="train", help="Hub split to read")
    p.add_argument("--validation_every", type=int, default=100,
                   help="1 document in N (by the CRC-32 of its text) goes to the validation split; 0: none")
    p.add_argument("--tasks", type=int, default=0, help="units of work; default: one per piece (at most 1024)")
    p.add_argument("--workers", type=int, default=0, help="tasks at a time; default: every core here (SLURM: all)")
    p.add_argument("--piece_mb", type=float, default=256, help="jsonl/parquet files are cut into pieces of this size")
    p.add_argument("--shard_tokens", type=int, default=1 << 30, help="tokens per shard file at most")
    p.add_argument("--max_bad_records", type=int, default=100, help="records that may be skipped; -1: no limit")
    p.add_argument("--slurm_partition", default="", help="run on SLURM in this partition (a job array of the tasks)")
    p.add_argument("--slurm_time", default="24:00:00", help="SLURM time limit of a task")
    p.add_argument("--slurm_mem_per_cpu_gb", type=int, default=4, help="SLURM memory per task")
    p.add_argument("--slurm_env_command", default="", help="shell line that sets up Python on a node; default: "
                   "this venv and this checkout on PYTHONPATH")
    a = p.parse_args(argv)
    for name in ("validation_every", "tasks", "workers", "piece_mb", "shard_tokens"):
        if not getattr(a, name) >= (1e-3 if name in ("piece_mb", "shard_tokens") else 0):
            p.error(f"--{name}: {getattr(a, name)} is out of range")
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    output = Path(a.output)
    try:
        request, pieces, total = build_request(a)
        if not claim_output(output, request):
            print(f"tessera: {output} is prepared already ({MANIFEST}); nothing to do", file=sys.stderr)
            return 0
        if a.slurm_partition:
            run_slurm(output, request, pieces, a)
            print(f"tessera: submitted {request['tasks']} tasks to SLURM; {output / MANIFEST} appears when they are "
                  f"done (run this command again to resume failed ones)", file=sys.stderr)
            return 0
        start = time.perf_counter()
        workers = run_local(output, request, pieces, total, a)
        manifest = Finish(str(output), a.max_bad_records).manifest()
    except DataError as e:  # the shared readers name the training options; here they are the command's
        print(f"tessera: {str(e).replace('training.dataset_text_field', '--text_field')}", file=sys.stderr)
        return 2
    seconds, tokens = time.perf_counter() - start, sum(s["tokens"] for s in manifest["splits"].values())
    cpu = sum(json.loads(f.read_text())["cpu_seconds"] for f in (output / WORK / "tasks").glob("*.json"))
    print(f"tessera: prepared {output}: {manifest['splits']['train']['tokens']:,} training tokens and "
          f"{manifest['splits']['validation']['tokens']:,} held out ({request['dtype']}), "
          f"{sum(len(s['shards']) for s in manifest['splits'].values())} shards, in {seconds:.1f}s: "
          f"{tokens / seconds:,.0f} tokens/s on {workers} worker(s); {tokens / max(cpu, 1e-6):,.0f} per CPU-second of "
          f"the tasks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from tessera.data import prepare  # the module by its name, so datatrove's workers unpickle its classes

    sys.exit(prepare.main(sys.argv[1:]))
