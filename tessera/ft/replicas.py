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
from datetime import timedelta

import torch
import xxhash
from torch.distributed.tensor import DTensor

from tessera.checkpoint.plain import plain_tensor
from tessera.config import ConfigError
from tessera.distributed import on_rank0
from tessera.ft import check

log = logging.getLogger("tessera")


def _local(value: torch.Tensor) -> torch.Tensor:
    value = plain_tensor(value)
    return value.to_local() if isinstance(value, DTensor) else value


def _digits(name: str) -> list[str]:
    """The job name's digest as 4 chunks of 4 hex digits (exact in float64, summed over the quorum)."""
    digest = xxhash.xxh64(name.encode()).hexdigest()
    return [digest[i:i + 4] for i in range(0, 16, 4)]


def quiet_torchft() -> None:
    """torchft logs every quorum and vote (its Rust side on stderr, its Python loggers at INFO): keep its warnings;
    Tessera logs what changes (quorum changes, recoveries, steps not committed). RUST_LOG=info brings them back."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its warnings are about NCCL's flight recorder
        logging.getLogger(name).propagate = name == "torchft"


class ReplicaGroup:
    """The torchft Manager of this group, and the trainer's hooks around it (see tessera/train.py: train_step)."""

    def __init__(self, tr):
        quiet_torchft()
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.tr, f = tr, tr.cfg.fault_tolerance
        on_rank0(lambda: check.check_live(tr.cfg, tr.world.size, hold=True))
        self.job, self.settings = check.identity(tr.cfg, tr.world.size)
        self.mixed = False  # a group of another job is in the quorum (warned once)
        self.store = None
        store_addr, store_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if store_addr is None or store_port is None:  # one process launched without torchrun: its own store
            self.store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self.store.port
        timeout = timedelta(seconds=f.timeout_seconds)
        pg = ProcessGroupNCCL(timeout) if tr.world.device.type == "cuda" else ProcessGroupGloo(timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=f.min_replica_size,
            use_async_quorum=False,  # a recovering group loads the peer's state before its forward: it trains too
            timeout=timeout, quorum_timeout=timedelta(seconds=f.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=f.connect_timeout_seconds), rank=tr.world.rank,
            world_size=tr.world.size, store_addr=store_addr, store_port=int(store_port),
            lighthouse_addr=check.lighthouse_address(tr.cfg), replica_id=f"tessera_{self.job}_{f.replica_id:04d}",
            init_sync=False)  # every group initializes the same weights from training.seed: nothing to copy at step 0
        self.manager.load_state_dict({"step": tr.step, "batches_committed": 0})  # resumed from a checkpoint: its step
        self.batches: list | None = None  # this step's batches, kept until it commits (run again if it does not)
        self.position = tr.loader.state_dict()  # the data position at the start of the step being run
        self.recovered_s: float | None = None  # set by _load: this step started with a recovery
        self.quorum = 0
        self.recoveries, self.recovery_s, self.degraded_steps, self.uncommitted = 0, 0.0, 0, 0
        self.below_min_since: int | None = None
        self.started = time.perf_counter()
        self._batch_index = 0
        fetch = tr.batch_fn
        tr.batch_fn = lambda loader: self._batch(fetch, loader)
        if tr.world.rank == 0:
            log.info(f"fault tolerance: {check.describe(tr.cfg)}; logs in {tr.cfg.job.dump_folder}")

    # ---- the step ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join this step's quorum; when behind the others, recover from a live peer first."""
        if delay := os.environ.get("TESSERA_FAULT_STEP_DELAY"):  # fault-injection for tests: a slower step
            time.sleep(float(delay))
        start = time.perf_counter()
        if self.batches is None:
            self.position = self.tr.loader.state_dict()
        self.recovered_s = None
        try:
            self.manager.start_quorum()
        except ConfigError:  # _load refused the peer's state
            raise
        except Exception as e:  # torchft's quorum RPC: the lighthouse (or this group's manager) is gone
            f = self.tr.cfg.fault_tolerance
            raise RuntimeError(f"fault tolerance: step {self.tr.step + 1}: no quorum ({str(e).splitlines()[0][:200]});"
                               f" is the lighthouse at {check.lighthouse_address(self.tr.cfg)} still up? (waited "
                               f"fault_tolerance.quorum_timeout_seconds = {f.quorum_timeout_seconds})") from e
        self._check_quorum()
        if self.recovered_s is not None:
            seconds = time.perf_counter() - start
            self.recoveries, self.recovery_s = self.recoveries + 1, self.recovery_s + seconds
            if self.tr.world.rank == 0:
                log.warning(f"fault tolerance: recovered step {self.tr.step} from a live replica group in "
                            f"{seconds:.2f}s (model, optimizer, scheduler, data position), "
                            f"{time.perf_counter() - self.started:.1f}s after this group's model was ready; quorum "
                            f"{self.manager.num_participants()} group(s)")
        self._batch_index = 0

    def _check_quorum(self) -> None:
        """Every group of the quorum is of this job, with these settings (a lighthouse may serve several jobs, and
        torchft forms one quorum of every group it hears). The quorum's job is that of its group furthest ahead
        (the lowest rank on a tie): a group of another job refuses itself; the others apply nothing of this step
        and go on once it has left."""
        me = self.manager.participating_rank()
        if me is None:
            return
        mine = [float(int(self.settings[i:i + 4], 16)) for i in range(0, 16, 4)]
        mine += [float(int(d, 16)) for d in _digits(self.job)]
        table = torch.zeros(self.manager.num_participants(), len(mine) + 1, dtype=torch.float64,
                            device=self.tr.world.device)
        table[me] = torch.tensor([*mine, self.tr.step], dtype=torch.float64)
        from torch.distributed import ReduceOp
        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return  # a peer failed: this step does not commit anyway
        rows = [row[:-1] for row in table.tolist()]
        lead = max(range(len(rows)), key=lambda i: (table[i, -1].item(), -i))
        if rows[lead] != mine:
            what = "job" if rows[lead][4:] != mine[4:] else "settings"
            raise ConfigError(f"fault_tolerance: the quorum on lighthouse {check.lighthouse_address(self.tr.cfg)} "
                              f"trains another {what} than this group (job '{self.job}', settings {self.settings}); "
                              f"give each job its own lighthouse, or every group of a job the same config and "
                              f"fault_tolerance.job_name")
        if any(row != mine for row in rows):
            self.manager.report_error(ConfigError("a replica group of another job is in the quorum"))
            if not self.mixed and self.tr.world.rank == 0:
                log.warning(f"fault tolerance: step {self.tr.step + 1}: a replica group of another job (or with other "
                            f"settings) joined the quorum; nothing applied until it has left")
        self.mixed = any(row != mine for row in rows)

    def _batch(self, fetch, loader):
        """The training loader's batches of this step, the same ones again when the step is run again."""
        if loader is not self.tr.loader:
            return fetch(loader)
        if self.batches is None:
            self.batches = []
        if self._batch_index == len(self.batches):
            self.batches.append(fetch(loader))
        self._batch_index += 1
        return self.batches[self._batch_index - 1]

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Each gradient (this rank's shard of it) averaged over the same rank of every group in the quorum, in
        flat buckets of about fault_tolerance.bucket_mb."""
        grads = [_local(p.grad) for p in self.tr.model.parameters() if p.grad is not None]
        limit = self.tr.cfg.fault_tolerance.bucket_mb * 2**20
        buckets: list[list[torch.Tensor]] = []
        for g in grads:
            last = buckets[-1] if buckets else None
            if last is None or last[0].dtype != g.dtype or sum(x.numel() for x in last) * g.element_size() > limit:
                buckets.append([g])
            else:
                last.append(g)
        pending = []
        for bucket in buckets:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            pending.append((self.manager.allreduce(flat), flat, bucket))
        for work, flat, bucket in pending:
            work.wait()
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def commit(self) -> bool:
        """The quorum's vote on this step: True = apply it (every group in the quorum does); False = nothing of
        it is applied, and the same step runs again on the same batches."""
        committed, before = self.manager.should_commit(), self.quorum
        self.quorum = self.manager.num_participants()
        if self.quorum != before and before and self.tr.world.rank == 0:
            log.warning(f"fault tolerance: step {self.tr.step + 1}: quorum {self.quorum} replica group(s), was "
                        f"{before}")
        size, least = self.tr.cfg.fault_tolerance.group_size, self.tr.cfg.fault_tolerance.min_replica_size
        if committed:
            self.batches = None
            self.degraded_steps += self.quorum < size
            if self.below_min_since is not None and self.tr.world.rank == 0:
                log.warning(f"fault tolerance: step {self.tr.step + 1} committed again, quorum {self.quorum} group(s)")
            self.below_min_since = None
            return True
        self.uncommitted += 1
        self.tr.optimizer.zero_grad()
        if self.tr.balancer is not None:
            from tessera.experts import reset_statistics
            reset_statistics(self.tr.balancer.layers)
        if self.below_min_since is None and self.tr.world.rank == 0:
            why = (f"quorum {self.quorum} group(s), below fault_tolerance.min_replica_size {least}"
                   if self.quorum < least else "a peer failed during the step")
            log.warning(f"fault tolerance: step {self.tr.step + 1} not committed ({why}); nothing applied, it runs "
                        f"again{' until enough groups join' if self.quorum < least else ''}")
        self.below_min_since = self.tr.step if self.quorum < least else None
        return False

    def saves(self) -> bool:
        """This group writes the job's checkpoints: the first live group of the quorum (the lowest id)."""
        return self.manager.participating_rank() == 0

    def metrics(self) -> dict[str, float]:
        record = {"ft/quorum": self.quorum, "ft/recoveries": self.recoveries, "ft/recovery_s": self.recovery_s,
                  "ft/degraded_steps": self.degraded_steps, "ft/uncommitted_steps": self.uncommitted}
        if "sample_index" in (position := self.tr.loader.state_dict()):  # the global data position reached
            record["ft/sample_index"] = position["sample_index"]
        if self.tr.cfg.fault_tolerance.log_state_digest:
            record["ft/state_digest"] = self.digest()
        return record

    def digest(self) -> str:
        """A hash of this rank's weights and optimizer state, bit for bit."""
        h = xxhash.xxh64()
        state = self._state()
        for tensor in [*state["model"].values(),
                       *(v for s in state["optimizer"]["state"].values() for v in s.values())]:
            if isinstance(tensor, torch.Tensor):
                h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        check.release()

    # ---- what a recovering group copies from a live one ----------------------------------------------
    def _state(self) -> dict:
        """This rank's shard of everything a group trains with (no collective: torchft calls it from its quorum
        thread, while the step waits for the quorum)."""
        tr = self.tr
        opt = tr.optimizer.state_dict()
        sharded = [(i, k) for i, s in opt["state"].items() for k, v in s.items() if isinstance(v, DTensor)]
        opt = {"state": {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                         for i, s in opt["state"].items()},
               "param_groups": opt["param_groups"], "sharded": sharded}
        return {"model": {k: _local(v) for k, v in tr.model.state_dict().items()}, "optimizer": opt,
                "job": [self.job, self.settings],
                "train": {"step": tr.step, "tokens_seen": tr.tokens_seen, "skipped_steps": tr.skipped_steps,
                          "lr_scheduler": tr.scheduler.state_dict(), "dataloader": dict(self.position),
                          "rng": torch.get_rng_state()}}

    @torch.no_grad()
    def _load(self, state: dict) -> None:
        tr, start = self.tr, time.perf_counter()
        if (theirs := state.get("job")) != [self.job, self.settings]:  # before anything is copied
            raise ConfigError(f"fault_tolerance: the live replica group this group would recover from runs job "
                              f"'{theirs[0]}' (settings {theirs[1]}), this group job '{self.job}' (settings "
                              f"{self.settings}); give each job its own lighthouse, or every group of a job the "
                              f"same config and fault_tolerance.job_name")
        ours = tr.model.state_dict()
        if ours.keys() != state["model"].keys():
            raise ConfigError("fault_tolerance: the live replica group holds another model (its parameter names "
                              "differ); every group runs the same config")
        for name, value in state["model"].items():
            target = _local(ours[name])
            if target.shape != value.shape:
                raise ConfigError(f"fault_tolerance: the live replica group's '{name}' has shape {list(value.shape)} "
                                  f"on this rank, this group {list(target.shape)}; every group runs the same model "
                                  f"and layout")
            target.copy_(value)
        params = [p for group in tr.optimizer.param_groups for p in group["params"]]
        opt = state["optimizer"]
        for i, key in opt.pop("sharded"):
            p = params[i]
            opt["state"][i][key] = DTensor.from_local(opt["state"][i][key].to(p.device), p.device_mesh, p.placements,
                                                      run_check=False, shape=p.shape, stride=p.stride())
        tr.optimizer.load_state_dict(opt)
        train = state["train"]
        tr.step, tr.tokens_seen, tr.skipped_steps = train["step"], train["tokens_seen"], train["skipped_steps"]
        tr.scheduler.load_state_dict(train["lr_scheduler"])
        tr.loader.load_state_dict(train["dataloader"])
        self.position, self.batches = dict(train["dataloader"]), None
        torch.set_rng_state(train["rng"])
        self.recovered_s = time.perf_counter() - start
