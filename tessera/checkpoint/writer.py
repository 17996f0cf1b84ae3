"""A DCP FileSystemWriter that hashes every file as its bytes are written, so the coordinator can record each
file's digest in the `.complete` marker without reading the checkpoint back.

Each rank's writer hashes the files it writes (through `FileSystem.create_stream`, which every DCP file write
goes through) and hands the digests to the coordinator among its write results: DCP gathers those to the
coordinator's `finish`, which takes them out again before `.metadata` is written, so the metadata stays plain DCP
(readable without Tessera). Works for `dcp.save` and `dcp.async_save` alike (the same writer object runs the
save in the background thread).
"""

import os
import threading
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tessera.checkpoint.folder import HashingFile

_DIGEST_FQN = "__tessera_digest__/"  # write results carrying a file's digest, not a tensor


class _HashingFileSystem(FileSystem):
    """DCP's local file system, with a digest of every file written through it ({file name: digest or None})."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str | None] = {}
        self.lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = HashingFile(raw)
            yield stream
        with self.lock:
            self.digests[Path(path).name] = stream.digest()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # .metadata.tmp -> .metadata
        with self.lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class HashingWriter(FileSystemWriter):
    """FileSystemWriter whose `digests` (on the coordinator, once the save has finished) hold every file of the
    checkpoint, from every rank, with its xxh3_64 digest."""

    def __init__(self, path: str | os.PathLike, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()
        self.digests: dict[str, str | None] = {}

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.fs.digests.clear()
        self.digests = {}

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()  # the files are written and closed here
        with self.fs.lock:
            written = dict(self.fs.digests)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results + [WriteResult(index=MetadataIndex(_DIGEST_FQN + name), size_in_bytes=0,
                                               storage_data=digest) for name, digest in written.items()])
        return done

    def finish(self, metadata, results: list[list[WriteResult]]) -> None:
        digests, tensors = {}, []
        for rank_results in results:
            tensors.append([r for r in rank_results if not r.index.fqn.startswith(_DIGEST_FQN)])
            digests.update({r.index.fqn.removeprefix(_DIGEST_FQN): r.storage_data for r in rank_results
                            if r.index.fqn.startswith(_DIGEST_FQN)})
        super().finish(metadata, tensors)  # writes .metadata through self.fs, which hashes it
        with self.fs.lock:
            digests.update({n: d for n, d in self.fs.digests.items() if n == ".metadata"})
        self.digests = digests
