"""Fault tolerance before ranks start (torch-free): the [fault_tolerance] values, the lighthouse answering, this
replica id free, and the live groups running the same config.

Files of a job under fault tolerance, in the job.dump_folder every group is given (a shared file system, as
checkpoints need one): each group's logs, metrics.jsonl and report in `replica_<id>/`, the checkpoints shared in
`<checkpoint.folder>` (written by one group: the lowest live id). A running group holds `replica_<id>/.lock`
(flock: released by the kernel however the process ends) and records its config's fingerprint next to it.
"""

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import socket
import urllib.error
import urllib.parse
import urllib.request

from tessera.config.manager import ConfigError
from tessera.config.sections import FaultTolerance, JobConfig

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LOCK, FINGERPRINT = ".lock", "ft-config.json"
# Settings that may differ between groups: where each writes, how it logs, and which group it is. Everything else,
# the layout inside a group included (gradients are averaged shard by shard), must be the same in every group.
_PER_GROUP = ("job.", "metrics.", "profiling.", "comm.", "checkpoint.", "generate.", "validation.",
              "fault_tolerance.replica_id", "fault_tolerance.lighthouse", "fault_tolerance.log_state_digest",
              "fault_tolerance.job_name")


def enabled(cfg: JobConfig) -> bool:
    return cfg.fault_tolerance.enable


def groups(cfg: JobConfig) -> int:
    """Replica groups the global batch is dealt to (1 without fault tolerance)."""
    return cfg.fault_tolerance.group_size if enabled(cfg) else 1


def data_share(cfg: JobConfig, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """(rank, degree) of this rank among every data-parallel rank of the job: group g's rank r is g x dp + r, the
    order HSDP's replicate x shard ranks have, so G groups x FSDP n read what HSDP G x n reads."""
    if not enabled(cfg):
        return dp_rank, dp_degree
    return cfg.fault_tolerance.replica_id * dp_degree + dp_rank, cfg.fault_tolerance.group_size * dp_degree


def lighthouse_address(cfg: JobConfig) -> str:
    """fault_tolerance.lighthouse, else $TORCHFT_LIGHTHOUSE, as http://HOST:PORT (a bare HOST:PORT gets http://)."""
    address = cfg.fault_tolerance.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    return address if not address or "://" in address else f"http://{address}"


def job_root(cfg: JobConfig) -> str:
    """The job's folder, of a config placed by place_group: the parent of this group's job.dump_folder."""
    return os.path.dirname(cfg.job.dump_folder)


def group_folder(cfg: JobConfig, replica_id: int | None = None) -> str:
    rid = cfg.fault_tolerance.replica_id if replica_id is None else replica_id
    return os.path.join(job_root(cfg), f"replica_{rid}")


def place_group(cfg: JobConfig) -> JobConfig:
    """The config as this replica group runs it (`cfg` itself without fault tolerance; `cfg` is not changed):
    job.dump_folder becomes <job.dump_folder>/replica_<id>, and a relative checkpoint.folder stays where it was
    (<job.dump_folder>/<checkpoint.folder>), shared. Semi-synchronous groups hold different weights inside a window
    and different inner optimizer states always: each saves its own, in <checkpoint.folder>/replica_<id>."""
    if not enabled(cfg):
        return cfg
    root, rid = cfg.job.dump_folder, cfg.fault_tolerance.replica_id
    folder = cfg.checkpoint.folder if os.path.isabs(cfg.checkpoint.folder) else \
        os.path.abspath(os.path.join(root, cfg.checkpoint.folder))
    if cfg.fault_tolerance.semi_sync_method != "none":
        folder = os.path.join(folder, f"replica_{rid}")
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, dump_folder=os.path.join(root, f"replica_{rid}")),
                               checkpoint=dataclasses.replace(cfg.checkpoint, folder=folder))


def check_config(cfg: JobConfig, args, has_own_data: bool) -> None:
    """The values of [fault_tolerance] and what they need, one line each."""
    if not enabled(cfg):
        if cfg.fault_tolerance.semi_sync_method != "none":
            raise ConfigError(f"fault_tolerance.semi_sync_method: {cfg.fault_tolerance.semi_sync_method} syncs "
                              f"replica groups, but fault_tolerance.enable is false; enable it (one launch per group) "
                              f"or leave the method at none")
        return
    f = cfg.fault_tolerance
    if f.replica_id >= f.group_size:
        raise ConfigError(f"fault_tolerance.replica_id: {f.replica_id} is not below group_size {f.group_size}; number "
                          f"the replica groups 0 .. {f.group_size - 1}")
    if f.min_replica_size > f.group_size:
        raise ConfigError(f"fault_tolerance.min_replica_size: {f.min_replica_size} is more than group_size "
                          f"{f.group_size}, so no step could commit; set it to at most {f.group_size}")
    if not lighthouse_address(cfg):
        raise ConfigError(f"fault_tolerance.lighthouse: empty and {LIGHTHOUSE_ENV} is not set; give the lighthouse's "
                          f"address (http://HOST:PORT; scripts/ft_local.sh starts one)")
    _check_address(lighthouse_address(cfg), cfg.fault_tolerance.lighthouse or os.environ.get(LIGHTHOUSE_ENV, ""))
    if not re.fullmatch(r"[A-Za-z0-9._-]*", f.job_name):
        raise ConfigError(f"fault_tolerance.job_name: {f.job_name!r} holds other characters than letters, digits, "
                          f"'.', '_' and '-'; it becomes part of torchft's replica ids")
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("fault_tolerance.enable: the torchft package is not installed; pip install --no-deps "
                          "torchft==0.2.0 (see requirements-dev.txt for its pins)")
    if has_own_data:
        raise ConfigError(f"fault_tolerance.enable: {cfg.model.name} deals its own data, which does not split over "
                          f"replica groups yet; train it without fault tolerance")
    if getattr(args, "moe", None) is not None and cfg.moe.load_balance_rate:
        raise ConfigError("fault_tolerance.enable: the MoE expert-bias update counts tokens inside one replica group, "
                          "so the groups' biases would drift apart; set moe.load_balance_rate = 0 under fault "
                          "tolerance (or train without it)")
    check_semi_sync(cfg)


_DILOCO_ONLY = ("num_fragments", "fragment_sync_delay", "fragment_update_alpha", "outer_lr", "outer_momentum",
                "outer_nesterov", "should_quantize")


def check_semi_sync(cfg: JobConfig) -> None:
    """fault_tolerance.semi_sync_method's settings fit together (tessera.ft.semisync has the schedule)."""
    f, defaults = cfg.fault_tolerance, FaultTolerance()
    if f.semi_sync_method == "none":
        return
    if f.semi_sync_method == "local_sgd" and (changed := [k for k in _DILOCO_ONLY
                                                          if getattr(f, k) != getattr(defaults, k)]):
        raise ConfigError(f"fault_tolerance.{changed[0]}: applies to semi_sync_method = diloco, this run is local_sgd "
                          f"(which averages the weights themselves); leave it at {getattr(defaults, changed[0])!r} "
                          f"or use diloco")
    if f.sync_steps % f.num_fragments:
        raise ConfigError(f"fault_tolerance.num_fragments: {f.num_fragments} does not divide sync_steps "
                          f"{f.sync_steps}; one fragment syncs every sync_steps / num_fragments steps")
    per = f.sync_steps // f.num_fragments
    if f.fragment_sync_delay >= per:
        raise ConfigError(f"fault_tolerance.fragment_sync_delay: {f.fragment_sync_delay} is not below sync_steps / "
                          f"num_fragments = {per}, so a fragment would be sent again before it is applied; lower it")
    if f.fragment_sync_delay and cfg.checkpoint.enable and cfg.checkpoint.interval % per:
        raise ConfigError(f"checkpoint.interval: {cfg.checkpoint.interval} is not a multiple of sync_steps / "
                          f"num_fragments = {per}; with fault_tolerance.fragment_sync_delay > 0 a checkpoint between "
                          f"a fragment's send and its apply would miss the send")
    if f.should_quantize and importlib.util.find_spec("triton") is None:
        raise ConfigError("fault_tolerance.should_quantize: torchft's quantized all-reduce needs triton (CUDA), "
                          "which is not installed; set it to false")
    if cfg.training.steps % per:
        early = " (a fragment in flight is applied early)" if f.fragment_sync_delay else ""
        logging.getLogger("tessera").warning(
            f"fault_tolerance.sync_steps: training.steps {cfg.training.steps} is not a multiple of {per}: the last "
            f"{cfg.training.steps % per} step(s) are not synced{early}; each group keeps its own weights there, and "
            f"the lowest live group saves")


def fingerprint(cfg: JobConfig, world_size: int) -> dict[str, object]:
    """What every group of the job must agree on: its config (less per-group settings) and its process count."""
    from tessera.config.manager import _leaves

    out: dict[str, object] = {"launch.world_size": world_size}
    for key, owner, f in _leaves(cfg):
        if not key.startswith(_PER_GROUP):
            out[key] = getattr(owner, f.name)
    return json.loads(json.dumps(out, default=str))


def identity(cfg: JobConfig, world_size: int) -> tuple[str, str]:
    """(job, settings): the job's name (fault_tolerance.job_name, else `cfg-` and the settings' first 8 hex
    digits) and a digest of what every group must agree on (fingerprint). One job's groups have both equal."""
    settings = hashlib.sha256(json.dumps(fingerprint(cfg, world_size), sort_keys=True).encode()).hexdigest()[:16]
    return cfg.fault_tolerance.job_name or f"cfg-{settings[:8]}", settings


def check_live(cfg: JobConfig, world_size: int, hold: bool = False) -> int | None:
    """The lighthouse answers, no live group has this replica id, and every live group runs this config. `hold`
    (rank 0 of a running group): keep this id's lock and record the fingerprint for the groups that come later;
    returns the lock's descriptor, which `release` gives up (and the process's end, however it ends)."""
    if not enabled(cfg):
        return None
    _probe_lighthouse(cfg)
    mine = fingerprint(cfg, world_size)
    folder = group_folder(cfg)
    os.makedirs(folder, exist_ok=True)
    fd = _try_lock(os.path.join(folder, LOCK))
    if fd is None:
        raise ConfigError(f"fault_tolerance.replica_id: {cfg.fault_tolerance.replica_id} is already running "
                          f"({_owner(folder)}); give each live replica group its own id, 0 .. "
                          f"{cfg.fault_tolerance.group_size - 1}")
    try:
        for rid in range(cfg.fault_tolerance.group_size):
            if rid != cfg.fault_tolerance.replica_id:
                _compare_live(cfg, rid, mine)
    except ConfigError:
        os.close(fd)
        raise
    if not hold:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{socket.gethostname()} pid {os.getpid()}".encode())
    with open(os.path.join(folder, FINGERPRINT), "w") as fh:
        json.dump(mine, fh, indent=1)
    return fd


def release(held: int | None) -> None:
    """Give up the replica id whose lock `check_live(hold=True)` returned (its group is done)."""
    if held is not None:
        os.close(held)


def _check_address(address: str, given: str) -> None:
    """An http(s)://HOST[:PORT] address (torchft's lighthouse speaks gRPC over HTTP/2)."""
    try:
        url = urllib.parse.urlsplit(address)
        url.port  # noqa: B018 (parses it: a port that is not a number or out of range raises)
        why = ""
    except ValueError as e:
        url, why = None, str(e)
    if any(c.isspace() or not c.isprintable() for c in address):
        why = "it holds a space or control character"
    elif url is not None and url.scheme not in ("http", "https"):
        why = f"scheme '{url.scheme}': the lighthouse speaks http"
    elif url is not None and not url.hostname:
        why = "no host name"
    if why:
        raise ConfigError(f"fault_tolerance.lighthouse: {given!r} is not a lighthouse address ({why}); give "
                          f"http://HOST:PORT (or HOST:PORT), e.g. http://lighthouse-host:29510")


def _probe_lighthouse(cfg: JobConfig) -> None:
    address = lighthouse_address(cfg)
    try:
        urllib.request.urlopen(f"{address.rstrip('/')}/status",
                               timeout=cfg.fault_tolerance.connect_timeout_seconds).close()
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise ConfigError(f"fault_tolerance.lighthouse: no lighthouse answers at {address} ({why}); start one "
                          f"(python -m tessera.lighthouse --min_replicas 1 --bind [::]:29510, or scripts/ft_local.sh) "
                          f"or fix the address") from None


def _try_lock(path: str) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _owner(folder: str) -> str:
    try:
        with open(os.path.join(folder, LOCK)) as fh:
            return fh.read().strip() or "another process"
    except OSError:
        return "another process"


def owner(cfg: JobConfig, rid: int) -> str:
    """Who runs (or ran) replica group `rid`: "HOST pid N", as its lock records it (for a line about a failed
    transfer with it; taking the lock to see whether it is free could refuse that group's relaunch meanwhile)."""
    folder = group_folder(cfg, rid)
    return _owner(folder) if os.path.exists(os.path.join(folder, LOCK)) else "not started from this folder"


def _compare_live(cfg: JobConfig, rid: int, mine: dict) -> None:
    """Group `rid`, when it is running now (holds its lock), was started with this config."""
    folder = group_folder(cfg, rid)
    lock = os.path.join(folder, LOCK)
    if not os.path.exists(lock):
        return
    fd = _try_lock(lock)
    if fd is not None:  # not running: its record is history
        os.close(fd)
        return
    try:
        with open(os.path.join(folder, FINGERPRINT)) as fh:
            theirs = json.load(fh)
    except (OSError, ValueError):
        return  # starting right now: the quorum's own checks follow
    diff = [k for k in mine if k in theirs and mine[k] != theirs[k]]
    if diff:
        key = diff[0]
        raise ConfigError(f"fault_tolerance: replica group {rid} (running) has {key} = {theirs[key]!r}, this group "
                          f"{mine[key]!r}{f' (and {len(diff) - 1} more difference(s))' if len(diff) > 1 else ''}; "
                          f"every group runs the same config and layout, only fault_tolerance.replica_id differs")


def describe(cfg: JobConfig) -> str:
    f = cfg.fault_tolerance
    semi = {"none": "gradients averaged every step", "local_sgd": f"local_sgd, weights averaged every {f.sync_steps} "
            f"steps", "diloco": f"diloco, synced every {f.sync_steps} steps in {f.num_fragments} fragment(s), outer "
            f"SGD lr {f.outer_lr} momentum {f.outer_momentum}{' Nesterov' if f.outer_nesterov else ''}"}
    return (f"replica group {f.replica_id} of {f.group_size} (min_replica_size {f.min_replica_size}), "
            f"{semi[f.semi_sync_method]}, lighthouse {lighthouse_address(cfg)}")
