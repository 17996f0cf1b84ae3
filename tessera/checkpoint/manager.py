"""DCP checkpoints that never lose work: atomic (a marker written once every rank is done), verified on
load, resumable on any layout (DCP reshards; the data position is global), optionally async.

A checkpoint is `<dump_folder>/<checkpoint.folder>/step-N/`: a DCP folder holding {"model", "optimizer",
"train"} ("model" only for exports and seed checkpoints), plus `config.toml` and `.complete`, a JSON
record of the files and their sizes that is written last.
"""

import io
import json
import logging
import os
import re
import shutil
import signal
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from tessera.config import ConfigError, JobConfig, to_toml

log = logging.getLogger("tessera")
MARKER = ".complete"
_STEP = re.compile(r"step-(\d+)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CorruptCheckpoint(RuntimeError):
    pass


def step_folders(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step-N folder, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := _STEP.match(name))]
    return sorted(found, reverse=True)


def read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


def verify(path: str, marker: dict) -> None:
    """Every file the marker lists exists with its recorded size; raises CorruptCheckpoint naming the file."""
    for name, size in marker["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpoint(f"{file} is missing")
        if os.path.getsize(file) != size:
            raise CorruptCheckpoint(f"{file} has {os.path.getsize(file)} bytes, {size} were written")


def write_marker(path: str, step: int, kind: str) -> None:
    files = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path)) if not n.startswith(MARKER)}
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"step": step, "kind": kind, "files": files}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, MARKER))  # atomic: the checkpoint exists from here on


def latest_complete(root: str, load_step: int = -1) -> tuple[int, str, dict] | None:
    """Newest complete and intact checkpoint (or exactly `load_step`), logging each one passed over."""
    for step, path in step_folders(root):
        if load_step >= 0 and step != load_step:
            continue
        marker = read_marker(path)
        try:
            if marker is None:
                raise CorruptCheckpoint(f"no {MARKER} marker: its save was interrupted")
            verify(path, marker)
        except CorruptCheckpoint as e:
            if load_step >= 0:
                raise ConfigError(f"checkpoint.load_step: step {step} at {path} is not usable: {e}") from None
            log.warning(f"skipping checkpoint step {step} ({e}); falling back to an earlier one")
            continue
        if marker["kind"] == "hf":
            continue
        return step, path, marker
    if load_step >= 0:
        raise ConfigError(f"checkpoint.load_step: no checkpoint for step {load_step} under {root}")
    return None


class Checkpointer:
    """Saves at intervals and at the end, resumes at start. One per run; rank 0 writes markers and purges."""

    def __init__(self, cfg: JobConfig, rank: int):
        self.cfg, self.c, self.rank = cfg, cfg.checkpoint, rank
        self.root = os.path.join(cfg.job.dump_folder, self.c.folder)
        self.distributed = dist.is_initialized()
        # Async saves run collectives from a background thread: give them their own group.
        self.pg = dist.new_group(backend="gloo") if self.distributed and self.c.async_mode != "disabled" else None
        self.pending: Future | None = None
        self.stall_s = 0.0  # training time lost to saving since the last report

    # ---- state ---------------------------------------------------------------------------------------
    def _state(self, tr, model_only: bool, dtype: torch.dtype | None = None) -> dict:
        model = get_model_state_dict(tr.model)
        if dtype is not None:
            model = {k: v.to(dtype) for k, v in model.items()}
        if model_only:
            return {"model": model}
        train = {"train_state": {"step": tr.step, "tokens_seen": tr.tokens_seen},
                 "lr_scheduler": tr.scheduler.state_dict(), "dataloader": tr.loader.state_dict(),
                 "rng": {"cpu": torch.get_rng_state(),
                         "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}}
        blob = io.BytesIO()
        torch.save(train, blob)
        blob.seek(0)
        return {"model": model, "optimizer": get_optimizer_state_dict(tr.model, tr.optimizer), "train": blob}

    # ---- save ----------------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        if not self.c.enable:
            return False
        return last or step % self.c.interval == 0 or (step == 1 and self.c.enable_first_step_checkpoint)

    def save(self, tr, last: bool = False) -> None:
        start = time.perf_counter()
        self.wait()  # a new save never races one still in flight
        model_only = last and self.c.last_save_model_only
        path = os.path.join(self.root, f"step-{tr.step}")
        if last and self.c.last_save_in_hf:
            from tessera.checkpoint.hf import save_hf
            save_hf(get_model_state_dict(tr.model), tr.model_args, path, dtype=_DTYPES[self.c.export_dtype],
                    family=self.cfg.model.name)
            self._finish(path, tr.step, "hf")
        else:
            dtype = _DTYPES[self.c.export_dtype] if model_only else None
            state = self._state(tr, model_only, dtype)
            kind = "model" if model_only else "full"
            if self.c.async_mode != "disabled" and not last:
                self.pending = self._async_save(state, path)
                self.pending.add_done_callback(lambda f, p=path, s=tr.step, k=kind: f.exception() or
                                               self._finish(p, s, k))
            else:
                dcp.save(state, checkpoint_id=path, process_group=self.pg)
                self._finish(path, tr.step, kind)
        stall = time.perf_counter() - start
        self.stall_s += stall
        log.info(f"checkpoint step {tr.step} {'queued' if self.pending else 'saved'} to {path} "
                 f"(training stalled {stall:.2f}s)")

    def save_seed(self, tr) -> None:
        """Step 0, model only, fp32: the common starting point of every layout."""
        path = os.path.join(self.root, "step-0")
        dcp.save({"model": get_model_state_dict(tr.model)}, checkpoint_id=path)
        self._finish(path, 0, "model")
        log.info(f"seed checkpoint written to {path}; any layout with checkpoint.enable loads it as step 0")

    def _async_save(self, state: dict, path: str) -> Future:
        stager = None
        if self.c.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False))
        resp = dcp.async_save(state, checkpoint_id=path, process_group=self.pg, async_stager=stager)
        return resp if isinstance(resp, Future) else resp.upload_completion

    def _finish(self, path: str, step: int, kind: str) -> None:
        """Runs once DCP has returned, i.e. every rank has written and the metadata exists."""
        if self.rank != 0:
            return
        with open(os.path.join(path, "config.toml"), "w") as fh:
            fh.write(to_toml(self.cfg))
        if os.environ.get("TESSERA_FAULT_KILL_BEFORE_MARKER") == str(step):  # fault-injection for tests
            os.kill(os.getpid(), signal.SIGKILL)
        write_marker(path, step, kind)
        self._purge(step)

    def _purge(self, newest: int) -> None:
        """Keep the newest keep_latest_k complete checkpoints; drop older ones and older interrupted saves."""
        folders = step_folders(self.root)
        complete = [path for _, path in folders if read_marker(path) is not None]
        keep = set(complete[: self.c.keep_latest_k] if self.c.keep_latest_k else complete)
        for step, path in folders:
            if step < newest and path not in keep:  # newer folders may still be in flight
                shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    # ---- load ----------------------------------------------------------------------------------------
    def load(self, tr) -> None:
        """Resume from the folder; else start from initial_load_path; else leave the fresh model."""
        if not self.c.enable:
            return
        found = error = None
        if self.rank == 0:
            try:
                found = latest_complete(self.root, self.c.load_step)
            except ConfigError as e:
                error = str(e)
        if self.distributed:  # every rank loads what rank 0 chose, or fails with it
            box = [found, error]
            dist.broadcast_object_list(box, src=0)
            found, error = box
        if error:
            raise ConfigError(error)
        if found is not None:
            step, path, marker = found
            self._load(tr, path, model_only=marker["kind"] == "model", step=step)
            log.info(f"resumed from checkpoint step {step} at {path}")
        elif self.c.initial_load_path:
            self._initial_load(tr)

    def _initial_load(self, tr) -> None:
        path = self.c.initial_load_path
        if self.c.initial_load_in_hf:
            from tessera.checkpoint.hf import load_hf
            load_hf(tr.model, path, family=self.cfg.model.name)
        else:
            if not os.path.isfile(os.path.join(path, ".metadata")):
                raise ConfigError(f"checkpoint.initial_load_path: '{path}' is not a DCP checkpoint (no .metadata)")
            self._load(tr, path, model_only=self.c.initial_load_model_only, step=0)
        log.info(f"initialized from {path}{' (Hugging Face)' if self.c.initial_load_in_hf else ''}")

    def _load(self, tr, path: str, model_only: bool, step: int) -> None:
        excluded = set(self.c.exclude_from_loading)
        model_only = model_only or {"optimizer", "train_state"} <= excluded
        state = self._state(tr, model_only)
        if "optimizer" in excluded:
            state.pop("optimizer", None)
        if "train" in state:
            state["train"] = io.BytesIO()
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.pg)
        except Exception as e:  # DCP names the storage error; add which checkpoint it was
            raise CorruptCheckpoint(f"loading checkpoint {path} failed: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}") from e
        set_model_state_dict(tr.model, state["model"], options=StateDictOptions(strict=True))
        if "optimizer" in state:
            set_optimizer_state_dict(tr.model, tr.optimizer, state["optimizer"])
        if "train" not in state:
            tr.step = step
            return
        state["train"].seek(0)
        train = torch.load(state["train"], weights_only=False)
        if "train_state" not in excluded:
            tr.step, tr.tokens_seen = train["train_state"]["step"], train["train_state"]["tokens_seen"]
        if "lr_scheduler" not in excluded:
            tr.scheduler.load_state_dict(train["lr_scheduler"])
        if "dataloader" not in excluded:
            tr.loader.load_state_dict(train["dataloader"])
        if "rng" not in excluded:
            torch.set_rng_state(train["rng"]["cpu"])
            if train["rng"]["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(train["rng"]["cuda"])
