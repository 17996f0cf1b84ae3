"""DCP checkpoints that never lose work: atomic (a marker written once every rank is done), verified on
load, resumable on any layout (DCP reshards; the data position is global), optionally async.

A checkpoint is `<dump_folder>/<checkpoint.folder>/step-N/` (see folder.py): a DCP folder holding {"model",
"optimizer", "train"} ("model" only for seed checkpoints), `config.toml`, `model.json` and `.complete`. The final
save of a run is a full checkpoint like the others; the exports it may add (model-only in a dtype, or Hugging Face)
go to `exports/step-N/`, which resuming never reads.
"""

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from tessera.checkpoint.folder import (
    DAMAGED,
    EXPORTS,
    MARKER,
    MODEL_RECORD,
    CorruptCheckpoint,
    read_marker,
    read_saved_config,
    step_folders,
    verify,
    write_hashed,
    write_marker,
)
from tessera.checkpoint.plain import model_state, read_train, train_blob, train_target
from tessera.checkpoint.resume import verify_shared
from tessera.checkpoint.run_state import Part, Progress, Saved
from tessera.checkpoint.space import save_failure
from tessera.checkpoint.writer import HashingWriter
from tessera.config import ConfigError, JobConfig, to_toml
from tessera.data.fingerprint import RECORD as INPUTS, inputs_print
from tessera.distributed import on_rank0
from tessera.dtypes import DTYPES
from tessera.lora import is_adapter
from tessera.models import args_to_json, family
from tessera.optim import settings_changed

log = logging.getLogger("tessera")
__all__ = ["MARKER", "Checkpointer", "CorruptCheckpoint", "Progress", "Saved", "read_marker", "step_folders", "verify",
           "write_marker"]


ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"  # DCP's note, on each call without a group


@contextlib.contextmanager
def _one_process_quiet():
    """DCP in one process (no process group) says so on every save and load; that is the intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS)
        yield


def write_run_record(folder: str, cfg: JobConfig, args) -> dict[str, str]:
    """`config.toml` and `model.json` (the architecture, which a flavor left empty does not name) in `folder`;
    their digests."""
    return {"config.toml": write_hashed(os.path.join(folder, "config.toml"), to_toml(cfg)),
            MODEL_RECORD: write_hashed(os.path.join(folder, MODEL_RECORD),
                                       json.dumps(args_to_json(cfg.model.name, args), indent=1))}


def probe_writable(folder: str, need_bytes: int = 0) -> None:
    """Create `folder` and write a file in it, now rather than at the first save; refuse one without room for
    `need_bytes`."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-probe-{uuid.uuid4().hex}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"cannot write to '{folder}' ({e.strerror or e}); pick a writable job.dump_folder or "
                          f"checkpoint.folder") from None
    free = shutil.disk_usage(folder).free
    if need_bytes > free:
        raise ConfigError(f"'{folder}' has {free / 2**30:.2f} GiB free, but one checkpoint of this model needs about "
                          f"{need_bytes / 2**30:.2f} GiB; free some space or pick another job.dump_folder")


def check_shapes(path: str, model_state: dict) -> None:
    """The checkpoint holds every model tensor with the model's (global) shape: else one line naming the first
    difference, instead of DCP's error at load."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    for name, value in model_state.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            raise ConfigError(f"job.dump_folder: the checkpoint at {path} has no tensor '{name}', so it holds another "
                              f"model; resume it with its own model settings or pick another job.dump_folder")
        if tuple(meta.size) != tuple(value.shape):
            raise ConfigError(f"job.dump_folder: the checkpoint at {path} holds '{name}' with shape "
                              f"{list(meta.size)}, the model asked for has {list(value.shape)}; resume it with its "
                              f"own model settings or pick another job.dump_folder")


def has_key(path: str, prefix: str) -> bool:
    """The checkpoint at `path` holds an entry whose name starts with `prefix`."""
    return any(k.startswith(prefix) for k in FileSystemReader(path).read_metadata().state_dict_metadata)


def checkpoint_state(parts: list[Part]) -> dict:
    """A full checkpoint's state dict: each part laid out like the model under its name, the others in one blob,
    "train" (in the parts' order: model, optimizer, train, semi_sync)."""
    state, train = {}, {}
    for part in parts:
        if part.laid_out:
            state[part.name] = part.state_dict()
        else:
            train[part.name] = part.state_dict()
            state["train"] = train  # its place among the entries; the blob below
    if train:
        state["train"] = train_blob(train)
    return state


class Checkpointer:
    """Saves at intervals and at the end, resumes at start. One per run; rank 0 writes markers and purges."""

    def __init__(self, cfg: JobConfig, rank: int, model_args, parts: Saved, damaged: set[str] | None = None):
        self.cfg, self.c, self.rank, self.model_args, self.parts = cfg, cfg.checkpoint, rank, model_args, parts
        self.root = os.path.join(cfg.job.dump_folder, self.c.folder)
        self.distributed = dist.is_initialized()
        # Async saves run collectives from a background thread: give them their own group.
        self.pg = dist.new_group(backend="gloo") if self.distributed and self.c.async_mode != "disabled" else None
        if not self.distributed and self.c.async_mode != "disabled":  # DCP's upload thread says it outside any call
            warnings.filterwarnings("ignore", message=ONE_PROCESS, module="torch.distributed.checkpoint")
        self.pending: Future | None = None
        self.settled = threading.Event()  # the save in flight has ended (set by its callback)
        self.failure: str | None = None  # a save that failed, in one line (save_failure)
        self.need_bytes = 0  # an estimate of one checkpoint's size, until one is written
        self.stall_s = 0.0  # training time lost to saving since the last report
        self.said_slow = False  # a save longer than checkpoint.signal_grace_seconds was said (once a run)
        self.verified: set[str] = set()  # checkpoints this run wrote or content-checked: purging keeps the newest
        self.damaged = set(damaged or ())  # found damaged at resume: not counted among the ones to keep
        # What the data position depends on (data files, tokenizer), recorded in each full checkpoint.
        self.inputs = inputs_print(cfg) if rank == 0 and self.c.enable and not family(cfg.model.name).own_data \
            else None

    # ---- state ---------------------------------------------------------------------------------------
    def _state(self, model_only: bool, dtype: torch.dtype | None = None) -> dict:
        if model_only:
            model = model_state(self.parts.model)
            return {"model": {k: v.to(dtype) for k, v in model.items()} if dtype is not None else model}
        return checkpoint_state(self.parts.parts())

    # ---- save ----------------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        if not self.c.enable:
            return False
        return last or step % self.c.interval == 0 or (step == 1 and self.c.enable_first_step_checkpoint)

    def prepare(self, bytes_per_checkpoint: int) -> None:
        """Before the first step: the checkpoint folder can be written and has room for a checkpoint."""
        self.need_bytes = bytes_per_checkpoint
        if self.c.enable:
            on_rank0(lambda: probe_writable(self.root, bytes_per_checkpoint))

    def save(self, last: bool = False, sync: bool = False, purge: bool = True) -> None:
        """A full checkpoint (synchronous at the end of the run, or when `sync`), then, at the end, the exports
        asked for. A save that fails leaves `failure` (one line) for the step boundary to stop the run with.
        `purge`: drop the checkpoints keep_latest_k no longer keeps (a stop leaves that to the next run)."""
        start, step = time.perf_counter(), self.parts.progress.step
        self.wait()  # a new save never races one still in flight
        path = self._fresh_folder(os.path.join(self.root, f"step-{step}"))
        state, writer = self._state(model_only=False), HashingWriter(path)
        if self.c.async_mode != "disabled" and not (last or sync):
            self.pending, self.settled = self._async_save(state, writer), threading.Event()
            self.pending.add_done_callback(
                lambda f, p=path, s=step, done=self.settled: self._settle(f, p, s, writer, start, purge, done))
        else:
            try:
                with _one_process_quiet():
                    dcp.save(state, storage_writer=writer, process_group=self.pg)
                error = None
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                error = e
            self._settle(error, path, step, writer, start, purge)
        stall = time.perf_counter() - start
        self.stall_s += stall
        if self.failure is None:
            log.info(f"checkpoint step {step} {'queued' if self.pending else 'saved'} to {path} "
                     f"(training stalled {stall:.2f}s)")
        if last and self.failure is None and (self.c.last_save_in_hf or self.c.last_save_model_only):
            self.export()

    def _settle(self, outcome: Future | BaseException | None, path: str, step: int, writer: HashingWriter,
                start: float, purge: bool, done: threading.Event | None = None) -> None:
        """A save's end (in the background for an async one, given its future): its marker, or its folder
        removed and `failure`."""
        try:
            error = outcome
            if isinstance(outcome, Future):
                error = RuntimeError("the save was cancelled") if outcome.cancelled() else outcome.exception()
            if error is None:
                try:
                    self._finish(path, step, "full", writer.digests, purge)
                except OSError as e:  # the marker or the run record (rank 0): a full disk, most likely
                    error = e
                self._longer_than_grace(step, time.perf_counter() - start)
            if error is not None:
                if self.rank == 0:
                    shutil.rmtree(path, ignore_errors=True)  # every rank is done with it: DCP gathered them
                self.failure = save_failure(step, path, self.root, error, self.need_bytes)
        finally:
            if done is not None:
                done.set()

    def export(self) -> str:
        """The model alone, in export_dtype, at exports/step-N: Hugging Face safetensors or a DCP folder."""
        tr, step = self.parts, self.parts.progress.step
        path = self._fresh_folder(os.path.join(self.root, EXPORTS, f"step-{step}"))
        dtype = DTYPES[self.c.export_dtype]
        digests = {}  # the HF writer's files (merged by rank 0 from every rank's shards) are read back instead
        lora = self.cfg.lora
        if self.c.last_save_in_hf and lora.rank and not lora.merge_on_export:
            from tessera.checkpoint.peft import save_peft
            base = self.c.initial_load_path if self.c.initial_load_in_hf else None
            save_peft(model_state(tr.model), lora, self.cfg.model.name, path, dtype,
                      os.path.abspath(base) if base else None)
            kind = "peft"
        elif self.c.last_save_in_hf:
            from tessera.checkpoint.hf import save_hf
            from tessera.checkpoint.peft import merged_state
            state = model_state(tr.model)
            save_hf(merged_state(state, lora) if lora.rank else state, self.model_args, path, dtype=dtype,
                    family=self.cfg.model.name, bos_id=tr.bos_id, eos_id=tr.eos_id,
                    carry_from=self.c.initial_load_path if self.c.initial_load_in_hf else None,
                    tokenizer_from=self.cfg.model.hf_assets_path or None)
            kind = "hf"
        else:
            writer = HashingWriter(path)
            with _one_process_quiet():
                dcp.save(self._state(model_only=True, dtype=dtype), storage_writer=writer, process_group=self.pg)
            digests, kind = writer.digests, "model"
        if self.rank == 0:
            write_marker(path, step, kind, {**digests, **write_run_record(path, self.cfg, self.model_args)})
        what = {"hf": "Hugging Face", "peft": "LoRA adapters, PEFT", "model": "DCP"}[kind]
        log.info(f"exported the model ({what}, {self.c.export_dtype}) to {path}")
        return path

    def save_seed(self) -> None:
        """Step 0, model only, fp32: the common starting point of every layout."""
        path = self._fresh_folder(os.path.join(self.root, "step-0"))
        writer = HashingWriter(path)
        with _one_process_quiet():
            dcp.save({"model": model_state(self.parts.model)}, storage_writer=writer)
        self._finish(path, 0, "model", writer.digests)
        log.info(f"seed checkpoint written to {path}; any layout with checkpoint.enable loads it as step 0")

    def _fresh_folder(self, path: str) -> str:
        """`path`, emptied of an earlier save's files (interrupted, or of a run resumed from an older step) before
        any rank writes: they would be listed with this one's; the broadcast orders it first. A damaged checkpoint
        there is set aside, not overwritten."""
        if path in self.damaged:
            self._set_aside(path)
        on_rank0(lambda: shutil.rmtree(path, ignore_errors=True))
        return path

    def _set_aside(self, path: str) -> None:
        """A damaged checkpoint moved to checkpoint.folder/damaged/ (neither resumed, purged nor overwritten there)
        for the user to repair or delete."""
        def move() -> str:
            target = os.path.join(self.root, DAMAGED, os.path.basename(path))
            for n in range(1, 1000):
                if not os.path.exists(target):
                    break
                target = os.path.join(self.root, DAMAGED, f"{os.path.basename(path)}.{n}")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(path, target)
            return target

        target = on_rank0(move)
        if self.rank == 0:
            log.warning(f"damaged checkpoint {path} moved to {target} (kept: repair or delete it)")
        self.damaged.discard(path)

    def _async_save(self, state: dict, writer: HashingWriter) -> Future:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        # The writer is a (blocking) stager too, which DCP would use; name the stager DCP uses for a path.
        pinned = self.c.async_mode == "async_with_pinned_mem"
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False) if pinned
                               else StagingOptions(False, False, False, False))
        with _one_process_quiet():
            resp = dcp.async_save(state, storage_writer=writer, process_group=self.pg, async_stager=stager)
        upload = resp if isinstance(resp, Future) else resp.upload_completion
        upload.add_done_callback(lambda _: stager.close())
        return upload

    def _longer_than_grace(self, step: int, seconds: float) -> None:
        """Said once a run, by rank 0: a save longer than a stop signal leaves before the kill."""
        grace = self.c.signal_grace_seconds
        if seconds > grace and self.rank == 0 and not self.said_slow:
            self.said_slow = True
            log.warning(f"checkpoint step {step} took {seconds:.1f}s to save, more than checkpoint."
                        f"signal_grace_seconds = {grace}: a stop signal's save would be killed before it ends, "
                        f"losing the steps since the checkpoint before; ask the scheduler for a longer lead (SLURM "
                        f"--signal=TERM@<seconds>, Kubernetes terminationGracePeriodSeconds, then raise "
                        f"signal_grace_seconds), or save more often with saves that overlap training "
                        f"(checkpoint.async_mode = \"async_with_pinned_mem\": staged in memory)")

    def _finish(self, path: str, step: int, kind: str, digests: dict, purge: bool = True) -> None:
        """Runs once DCP has returned, i.e. every rank has written and the metadata exists. `digests`: the DCP
        files', computed as they were written (on rank 0, DCP's coordinator)."""
        if self.rank != 0:
            return
        records = write_run_record(path, self.cfg, self.model_args)
        if kind == "full" and self.inputs:
            records[INPUTS] = write_hashed(os.path.join(path, INPUTS), json.dumps(self.inputs, indent=1))
        write_marker(path, step, kind, {**digests, **records})
        self.verified.add(path)
        if purge:
            self._purge(step)

    def _purge(self, newest: int) -> None:
        """Keep the newest keep_latest_k complete checkpoints, the newest full one always among them; drop older
        ones, older interrupted saves and older ones found damaged. Exports are the user's and stay."""
        folders = step_folders(self.root)
        markers = {path: read_marker(path) for _, path in folders}
        complete = [path for _, path in folders if markers[path] is not None and path not in self.damaged]
        keep = set(complete[: self.c.keep_latest_k] if self.c.keep_latest_k else complete)
        full = [path for path in complete if markers[path].get("kind") == "full"]
        # The newest full one, and the newest this run knows intact (saved or content-checked at resume): a newer
        # one may have been damaged in place since it was written.
        keep |= set(full[:1] + [path for path in full if path in self.verified][:1])
        for step, path in folders:
            if step < newest and path not in keep:  # newer folders may still be in flight
                shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        """Until the save in flight has ended, its marker written or its failure recorded."""
        if self.pending is not None:
            with contextlib.suppress(BaseException):  # its outcome is `_settle`'s to record
                self.pending.result()
            self.settled.wait()
            self.pending = None

    # ---- load ----------------------------------------------------------------------------------------
    def load(self, resume: tuple[int, str, dict] | None) -> None:
        """Resume from `resume` (a full checkpoint: everything; a seed: its weights, at step 0); else start from
        initial_load_path; else leave the fresh model."""
        if self.damaged and (resume is None or resume[2]["kind"] != "full"):  # start_fresh_if_all_damaged
            for path in sorted(self.damaged):
                self._set_aside(path)
        if resume is not None:
            step, path, marker = resume  # content-checked by confirm_resume
            self.verified.add(path)
            full = marker["kind"] == "full"
            if full and self.cfg.lora.rank and self.c.initial_load_path:
                self._initial_load()  # the base, which a LoRA run's checkpoints leave out
            self._load(path, model_only=not full)
            log.info(f"resumed from checkpoint step {step} at {path}" if full else
                     f"initialized from the weights-only checkpoint at {path}; training starts at step 0")
        elif self.c.enable and self.c.initial_load_path:
            self._initial_load()
        if (resume is None or resume[2]["kind"] != "full") and self.cfg.lora.initial_adapter_path:
            from tessera.checkpoint.peft import load_peft
            load_peft(self.parts.model, self.cfg.lora.initial_adapter_path, self.cfg.model.name)
            log.info(f"LoRA adapters from {self.cfg.lora.initial_adapter_path}")

    def _initial_load(self) -> None:
        path = self.c.initial_load_path
        if self.c.initial_load_in_hf:
            from tessera.checkpoint.hf import load_hf
            load_hf(self.parts.model, path, family=self.cfg.model.name, args=self.model_args)
        else:
            if not os.path.isfile(os.path.join(path, ".metadata")):
                raise ConfigError(f"checkpoint.initial_load_path: '{path}' is not a DCP checkpoint (no .metadata)")
            marker = on_rank0(lambda: read_marker(path))
            if marker is not None and (problem := verify_shared(path, marker)):
                raise ConfigError(f"checkpoint.initial_load_path: '{path}' is damaged: {problem}; pick another "
                                  f"checkpoint")
            self._load(path, model_only=self.c.initial_load_model_only, base=bool(self.cfg.lora.rank))
        log.info(f"initialized from {path}{' (Hugging Face)' if self.c.initial_load_in_hf else ''}")

    def _load(self, path: str, model_only: bool, base: bool = False) -> None:
        """`base`: the frozen base of a LoRA run, from a checkpoint that has no adapters."""
        excluded = set(self.c.exclude_from_loading)
        model_only = model_only or base or {"optimizer", "train_state"} <= excluded
        parts = [part for part in self.parts.parts()
                 if part.name == "model" or not (model_only or part.name in excluded)]
        state = self._state(model_only)
        if base:
            state["model"] = {k: v for k, v in state["model"].items() if not is_adapter(k)}
        check_shapes(path, state["model"])
        if "optimizer" in excluded:
            state.pop("optimizer", None)
        if "train" in state:
            state["train"] = train_target(path)
        if "semi_sync" in state and not has_key(path, "semi_sync."):
            log.warning(f"fault_tolerance.semi_sync_method = diloco: the checkpoint at {path} has no outer optimizer "
                        f"state (saved without diloco); the outer momentum starts at zero from its weights")
            del state["semi_sync"]
        try:
            with _one_process_quiet():
                dcp.load(state, checkpoint_id=path, process_group=self.pg)
        except Exception as e:  # DCP names the storage error; add which checkpoint it was
            raise CorruptCheckpoint(f"loading checkpoint {path} failed: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}") from e
        train = read_train(state["train"]) if "train" in state else {}
        for part in parts:  # in their order: the optimizer's settings before the lr schedule sets its lr
            if not part.laid_out:
                part.load_state_dict(train[part.name])
            elif part.name in state:  # not a diloco state the checkpoint lacks (warned above)
                part.load_state_dict(state[part.name])
                if part.name == "optimizer":
                    self._say_optimizer_changes(path)

    def _say_optimizer_changes(self, path: str) -> None:
        changed = settings_changed(read_saved_config(path).get("optimizer", {}), self.cfg.optimizer)
        if changed and self.rank == 0:
            log.warning(f"optimizer: {', '.join(changed)} since the checkpoint at {path}: applied from the next "
                        f"step; the optimizer's moments are kept and the lr schedule continues from the step "
                        f"reached with the new peak")
