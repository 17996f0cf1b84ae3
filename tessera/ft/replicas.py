"""One replica group's side of fault-tolerant training, on torchft's Manager.

Every step: a quorum of the live groups (through the lighthouse; a group that was away, or a new one, first copies
the model, optimizer, scheduler, step and data position from a live peer), the step's gradients averaged over the
quorum (each rank with the rank of the same place in every other group: the replicate dimension of HSDP, over a
process group torchft rebuilds when the quorum changes), then a vote: the step commits only when every rank of every
group in the quorum got its gradients through and the quorum holds at least min_replica_size groups. A step that does
not commit changes nothing; it is run again on the same batches.

Data: group g reads the samples HSDP's replicate rank g would (check.data_share). While a group is away the others
go on over their own shares; the away group's samples of those steps are skipped, not dealt to others. Its
recovery copies the global data position, which only moves forward: the rejoined group reads from the samples of the
step the others are at, never one it trained before.
"""

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import xxhash

from tessera.checkpoint.run_state import DATA, Saved
from tessera.config import ConfigError, JobConfig
from tessera.distributed import World, on_rank0
from tessera.ft import check
from tessera.ft.semisync import SemiSync, allreduce_buckets
from tessera.tensors import local

log = logging.getLogger("tessera")


def _digits(name: str) -> list[str]:
    """The job name's digest as 4 chunks of 4 hex digits (exact in float64, summed over the quorum)."""
    digest = xxhash.xxh64(name.encode()).hexdigest()
    return [digest[i:i + 4] for i in range(0, 16, 4)]


def quiet_torchft() -> None:
    """torchft logs every quorum and vote (its Rust side on stderr, its Python loggers at INFO): quiet; Tessera logs
    what changes (quorum changes, recoveries, steps and syncs that fail: which group and why, ReplicaGroup.failure).
    RUST_LOG=info brings torchft's Rust side back."""
    os.environ.setdefault("RUST_LOG", "warn")
    # Its Python warnings are about NCCL's flight recorder; its errors are a collective's own text and traceback
    # (gloo's "Timed out waiting 60000ms for recv operation"), which the manager also records for Tessera's line.
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
        logging.getLogger(name).propagate = name == "torchft"


def live_state(saved: Saved, job: list[str], position: dict, copy: bool) -> dict:
    """What a recovering group copies from this one: the job's identity (checked before anything is copied), then
    every part of the run's state (this rank's shards), the data position that of the start of the step being run
    (`position`: its batches may have been read already, for a step run again)."""
    return {"job": job, **{part.name: dict(position) if part.name == DATA else part.local_state_dict(copy)
                           for part in saved.parts()}}


def load_live_state(saved: Saved, state: dict) -> None:
    """Every part of the run's state from a live group's live_state (its shards of the same layout)."""
    if saved.outer is not None and "semi_sync" not in state:
        raise ConfigError("fault_tolerance.semi_sync_method: the live replica group runs without diloco; every "
                          "group runs the same config")
    for part in saved.parts():
        part.load_local_state_dict(state[part.name])


class ReplicaGroup:
    """The torchft Manager of this group, and the step's hooks around it (see tessera/train.py: train_step).
    `fetch`: (loader) -> a micro-batch, which `batch` wraps (the trainer's batch_fn)."""

    def __init__(self, cfg: JobConfig, world: World, saved: Saved, fetch: Callable, *, balancer=None,
                 model_args=None):
        quiet_torchft()
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.cfg, self.world, self.saved, self.fetch, self.balancer = cfg, world, saved, fetch, balancer
        self.model_args, f = model_args, cfg.fault_tolerance
        held = on_rank0(lambda: check.check_live(cfg, world.size, hold=True))
        self.held_id = held if world.rank == 0 else None  # the lock of this replica id, which rank 0 holds
        self.job, self.settings = check.identity(cfg, world.size)
        self.mixed = False  # a group of another job is in the quorum (warned once)
        self.store = None
        store_addr, store_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if store_addr is None or store_port is None:  # one process launched without torchrun: its own store
            self.store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self.store.port
        timeout = timedelta(seconds=f.timeout_seconds)
        pg = ProcessGroupNCCL(timeout) if world.device.type == "cuda" else ProcessGroupGloo(timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=f.min_replica_size,
            use_async_quorum=False,  # a recovering group loads the peer's state before its forward: it trains too
            timeout=timeout, quorum_timeout=timedelta(seconds=f.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=f.connect_timeout_seconds), rank=world.rank,
            world_size=world.size, store_addr=store_addr, store_port=int(store_port),
            lighthouse_addr=check.lighthouse_address(cfg), replica_id=f"tessera_{self.job}_{f.replica_id:04d}",
            init_sync=False)  # every group initializes the same weights from training.seed: nothing to copy at step 0
        self.manager.load_state_dict({"step": self.step, "batches_committed": 0})  # resumed: the checkpoint's step
        self.batches: list | None = None  # this step's batches, kept until it commits (run again if it does not)
        self.position = saved.data.state_dict()  # the data position at the start of the step being run
        self.recovered_s: float | None = None  # set by _load: this step started with a recovery
        self.members: list[int] = []  # the replica ids of the last quorum's groups, by rank in it (_check_quorum)
        self.quorum_syncs = False  # semi-synchronous: every group of the last quorum syncs there (_check_quorum)
        self.joiners: list[int] = []  # semi-synchronous: the last quorum's groups that are not at a sync
        self.quorum = 0
        self.recoveries, self.recovery_s, self.degraded_steps, self.uncommitted = 0, 0.0, 0, 0
        self.below_min_since: int | None = None
        self.started = time.perf_counter()
        self.syncs, self.sent_bytes, self.sync_s, self.tokens_at_start = 0, 0, 0.0, saved.progress.tokens_seen
        self.outer = saved.outer  # diloco: the outer optimizer and the weights at the last sync
        self.semi = SemiSync(self, self.outer) if f.semi_sync_method != "none" else None
        self._batch_index = 0
        if world.rank == 0:
            log.info(f"fault tolerance: {check.describe(cfg)}; logs in {cfg.job.dump_folder}")

    @property
    def step(self) -> int:
        return self.saved.progress.step

    # ---- the step ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join this step's quorum; when behind the others, recover from a live peer first. Semi-synchronous:
        meet the others before the first step only (then after_step)."""
        if self.semi is not None:
            if not self.semi.joined:
                self.semi.join()
            return
        if self.batches is None:
            self.position = self.saved.data.state_dict()
        self.start_quorum()
        self._batch_index = 0

    def after_step(self) -> None:
        """After a step is counted: semi-synchronous groups sync here when the schedule says so."""
        if self.semi is not None:
            self.semi.after_step()

    def start_quorum(self, wait: tuple[str, int] | None = None) -> None:
        """A quorum of the live groups; a group behind the others copies a live one's state (self.recovered_s).
        `wait`: (the option, its seconds) that bounds the wait, when not quorum_timeout_seconds."""
        start = time.perf_counter()
        self.recovered_s = None
        f = self.cfg.fault_tolerance
        key, seconds = wait or ("fault_tolerance.quorum_timeout_seconds", f.quorum_timeout_seconds)
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=seconds))
        except ConfigError:  # _load refused the peer's state
            raise
        except Exception as e:  # torchft's quorum RPC: the lighthouse (or this group's manager) is gone
            raise RuntimeError(f"fault tolerance: step {self.step + 1}: no quorum ({str(e).splitlines()[0][:200]});"
                               f" is the lighthouse at {check.lighthouse_address(self.cfg)} still up? (waited "
                               f"{key} = {seconds})") from e
        self._check_quorum()
        if self.recovered_s is not None:
            seconds = time.perf_counter() - start
            self.recoveries, self.recovery_s = self.recoveries + 1, self.recovery_s + seconds
            if self.world.rank == 0:
                log.warning(f"fault tolerance: recovered step {self.step} from a live replica group in "
                            f"{seconds:.2f}s (model, optimizer, scheduler, data position), "
                            f"{time.perf_counter() - self.started:.1f}s after this group's model was ready; quorum "
                            f"{self.manager.num_participants()} group(s)")

    def _check_quorum(self) -> None:
        """Every group of the quorum is of this job, with these settings (a lighthouse may serve several jobs, and
        torchft forms one quorum of every group it hears). The quorum's job is that of its group furthest ahead
        (the lowest rank on a tie): a group of another job refuses itself; the others apply nothing of this step
        and go on once it has left. The same table says each group's replica id (self.members, named when a
        sync fails) and, semi-synchronous, whether it syncs here (self.quorum_syncs: all or none of them do)."""
        self.quorum_syncs, self.joiners = False, []
        me = self.manager.participating_rank()
        if me is None:
            return
        mine = [float(int(self.settings[i:i + 4], 16)) for i in range(0, 16, 4)]
        mine += [float(int(d, 16)) for d in _digits(self.job)]
        # A group at a sync point syncs; a relaunched one in its first quorum (SemiSync.join) does not, unless it
        # copied a group at a sync. One that copied a relaunched one takes its place: nobody syncs then.
        syncs = self.semi is not None and (self.semi.at_sync or self.recovered_s is not None)
        table = torch.zeros(self.manager.num_participants(), len(mine) + 3, dtype=torch.float64,
                            device=self.world.device)
        table[me] = torch.tensor([*mine, self.cfg.fault_tolerance.replica_id, syncs, self.step], dtype=torch.float64)
        from torch.distributed import ReduceOp
        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return  # a peer failed: this step does not commit anyway
        self.members = [int(i) for i in table[:, -3].tolist()]
        self.joiners = [rid for rid, flag in zip(self.members, table[:, -2].tolist(), strict=True) if not flag]
        self.quorum_syncs = self.semi is not None and not self.joiners
        rows = [row[:len(mine)] for row in table.tolist()]
        lead = max(range(len(rows)), key=lambda i: (table[i, -1].item(), -i))
        if rows[lead] != mine:
            what = "job" if rows[lead][4:] != mine[4:] else "settings"
            raise ConfigError(f"fault_tolerance: the quorum on lighthouse {check.lighthouse_address(self.cfg)} "
                              f"trains another {what} than this group (job '{self.job}', settings {self.settings}); "
                              f"give each job its own lighthouse, or every group of a job the same config and "
                              f"fault_tolerance.job_name")
        if any(row != mine for row in rows):
            self.manager.report_error(ConfigError("a replica group of another job is in the quorum"))
            if not self.mixed and self.world.rank == 0:
                log.warning(f"fault tolerance: step {self.step + 1}: a replica group of another job (or with other "
                            f"settings) joined the quorum; nothing applied until it has left")
        self.mixed = any(row != mine for row in rows)

    def batch(self, loader):
        """The trainer's batch_fn: the training loader's batches of this step, the same ones again when the step is
        run again."""
        if loader is not self.saved.data or self.semi is not None:  # semi-synchronous: every inner step applies
            return self.fetch(loader)
        if self.batches is None:
            self.batches = []
        if self._batch_index == len(self.batches):
            self.batches.append(self.fetch(loader))
        self._batch_index += 1
        return self.batches[self._batch_index - 1]

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Each gradient (this rank's shard of it) averaged over the same rank of every group in the quorum, in
        flat buckets of about fault_tolerance.bucket_mb."""
        if self.semi is not None:  # each group steps on its own gradients
            return
        start = time.perf_counter()
        grads = [local(p.grad) for p in self.saved.model.parameters() if p.grad is not None]
        sent, wait = allreduce_buckets(self.manager, grads, self.cfg.fault_tolerance.bucket_mb * 2**20)
        wait()
        self.sent_bytes, self.sync_s = self.sent_bytes + sent, self.sync_s + time.perf_counter() - start

    def commit(self) -> bool:
        """The quorum's vote on this step: True = apply it (every group in the quorum does); False = nothing of
        it is applied, and the same step runs again on the same batches."""
        if self.semi is not None:  # an inner step: applied (the groups meet in after_step)
            self.batches = None
            return True
        committed = self.manager.should_commit()
        self.syncs += committed
        self.note_quorum()
        size, least = self.cfg.fault_tolerance.group_size, self.cfg.fault_tolerance.min_replica_size
        if committed:
            self.batches = None
            self.degraded_steps += self.quorum < size
            if self.below_min_since is not None and self.world.rank == 0:
                log.warning(f"fault tolerance: step {self.step + 1} committed again, quorum {self.quorum} group(s)")
            self.below_min_since = None
            return True
        self.uncommitted += 1
        self.saved.optimizer.zero_grad()
        if self.balancer is not None:
            from tessera.experts import reset_statistics
            reset_statistics(self.balancer.layers)
        if self.below_min_since is None and self.world.rank == 0:
            why = (f"quorum {self.quorum} group(s), below fault_tolerance.min_replica_size {least}"
                   if self.quorum < least else self.failure())
            log.warning(f"fault tolerance: step {self.step + 1} not committed ({why}); nothing applied, it runs "
                        f"again{' until enough groups join' if self.quorum < least else ''}")
        self.below_min_since = self.step if self.quorum < least else None
        return False

    def failure(self) -> str:
        """Why this step's transfers with the other groups failed, and with which (one line, not the collective's
        own text): from the error the manager recorded on this rank."""
        error = self.manager.errored()
        if error is None:
            return "another rank of this group failed"
        error = getattr(error, "original_exception", error)
        text, f = str(error).strip(), self.cfg.fault_tolerance
        if isinstance(error, TimeoutError) or "timed out" in text.lower():
            what = f"got no answer within fault_tolerance.timeout_seconds = {f.timeout_seconds}"
        elif any(s in text for s in ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")):
            what = "lost its connection (a group stopped, ended or was restarted)"
        else:
            what = f"failed: {(text.splitlines() or [type(error).__name__])[0][:200]}"
        return f"the transfer with {self.name([rid for rid in self.members if rid != f.replica_id])} {what}"

    def name(self, ids: list[int]) -> str:
        """'replica group 1 (HOST pid N)', several joined by commas."""
        named = [f"{rid} ({check.owner(self.cfg, rid)})" for rid in ids]
        return f"replica group{'s' if len(ids) > 1 else ''} {', '.join(named)}" if ids else "no other replica group"

    def note_quorum(self) -> None:
        """After a commit vote: the quorum's size, a change of it logged."""
        before, self.quorum = self.quorum, self.manager.num_participants()
        if self.quorum != before and before and self.world.rank == 0:
            log.warning(f"fault tolerance: step {self.step + 1}: quorum {self.quorum} replica group(s), was "
                        f"{before}")

    def saves(self) -> bool:
        """This group writes the job's checkpoints: the first live group of the quorum (the lowest id); every
        semi-synchronous group writes its own."""
        return self.semi is not None or self.manager.participating_rank() == 0

    def metrics(self) -> dict[str, float]:
        record = {"ft/quorum": self.quorum, "ft/recoveries": self.recoveries, "ft/recovery_s": self.recovery_s,
                  "ft/degraded_steps": self.degraded_steps, "ft/uncommitted_steps": self.uncommitted}
        semi = self.semi
        syncs, sent, seconds = (semi.syncs, semi.sent_bytes, semi.seconds) if semi else (self.syncs, self.sent_bytes,
                                                                                          self.sync_s)
        tokens = self.saved.progress.tokens_seen - self.tokens_at_start  # this group's, since this launch started
        record.update({"ft/syncs": syncs, "ft/sync_mb": sent / 2**20, "ft/sync_s": seconds,
                       # every rank sends its part: the group's bytes over the group's tokens
                       "ft/mb_per_sync": sent / 2**20 / syncs if syncs else 0.0,
                       "ft/sync_bytes_per_token": sent * self.world.size / tokens if tokens else 0.0})
        if semi is not None:
            record["ft/failed_syncs"] = semi.failed
        if "sample_index" in (position := self.saved.data.state_dict()):  # the global data position reached
            record["ft/sample_index"] = position["sample_index"]
        if self.cfg.fault_tolerance.log_state_digest:
            record["ft/state_digest"] = self.digest()
            if semi is not None:  # the groups' inner optimizers differ; right after a sync their weights do not
                record["ft/weights_digest"] = self.digest(weights_only=True)
        return record

    def digest(self, weights_only: bool = False) -> str:
        """A hash of this rank's weights and optimizer state (diloco: the outer state too), bit for bit."""
        h = xxhash.xxh64()
        state = self._state()
        outer = [v for part in state.get("semi_sync", {}).values() for v in part.values()]
        inner = [v for s in state["optimizer"]["state"].values() for v in s.values()]
        for tensor in [*state["model"].values(), *([] if weights_only else [*inner, *outer])]:
            if isinstance(tensor, torch.Tensor):
                h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        check.release(self.held_id)

    # ---- what a recovering group copies from a live one ----------------------------------------------
    def _state(self) -> dict:
        """This rank's shard of everything a group trains with (no collective: torchft calls it from its quorum
        thread, while the step waits for the quorum). Semi-synchronous: copies, as this group goes on training while
        the recovering one reads them."""
        return live_state(self.saved, [self.job, self.settings], self.position, copy=self.semi is not None)

    def _load(self, state: dict) -> None:
        start = time.perf_counter()
        if (theirs := state.get("job") or ["?", "?"]) != [self.job, self.settings]:  # before anything is copied
            raise ConfigError(f"fault_tolerance: the live replica group this group would recover from runs job "
                              f"'{theirs[0]}' (settings {theirs[1]}), this group job '{self.job}' (settings "
                              f"{self.settings}); give each job its own lighthouse, or every group of a job the "
                              f"same config and fault_tolerance.job_name")
        load_live_state(self.saved, state)
        self.position, self.batches = dict(state["dataloader"]), None
        self.recovered_s = time.perf_counter() - start
