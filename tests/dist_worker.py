"""Runs training cases on a pool of ranks and saves what the tests compare.

    python tests/dist_worker.py QUEUE_DIR N

The ranks stay up for the whole test run (tests/launch.py's `RankPool` starts them once per world size, so a
launch is paid once, not per test). This process imports what the ranks run, then forks them (`start_ranks`): N
ranks start in the time of one import instead of N (2.3 s of CPU each, ~40 s at 16 ranks on two cores). Each job
is a file `QUEUE_DIR/job-K.pt` holding (function, cases, steps), the function named "module:name" and called as
function(case, steps) for each case in order; rank 0 writes the list of what it returned to `result-K.pt`; then
the ranks drop every process group but the world's. A rank that fails writes `error-K-RANK.txt` and exits, which
ends the pool (the parent stops the other ranks, as torchrun would); the next job starts a fresh one.

run_grads: per-step losses and step-1 gradients (full tensors), in a temporary dump folder.
run_train: the real `train()` loop (checkpoints and resume included, in the case's dump folder):
per-step losses, the ids (content hashes) of the samples each step consumed over all DP ranks, and the
final parameters. The same functions run in-process for single-process references.
"""

import gc
import importlib
import itertools
import os
import signal
import socket
import sys
import tempfile
import traceback
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache

from tessera.distributed import init_world, shutdown, world_size_from_env
from tessera.parallel.init import bare_name
from tessera.parallel.tp import local
from tessera.preflight import validate
from tessera.schema import parse_args
from tessera.train import dp_mean, side_loss_metrics, train, train_step, validate_loss
from tessera.trainer import build_trainer
from tests.launch import merge

# max_norm below the tiny model's grad norms (~0.9): every step clips. MFU's denominator given: measuring a GEMM
# (0.3 s on every rank) was most of a tiny case's time.
BASE = ["--model.flavor", "tiny", "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "2",
        "--optimizer.lr", "3e-3", "--training.deterministic", "--metrics.log_freq", "1",
        "--training.max_norm", "0.5", "--metrics.peak_flops", "1e11"]


def _trainer(argv: list[str], steps: int, dump: str):
    cfg = parse_args(merge(BASE, ["--job.dump_folder", dump, "--training.steps", str(steps)], argv))
    run = validate(cfg, world_size_from_env())
    return build_trainer(run, init_world(run.dims))


def full_params(model, attr: str = "") -> dict[str, torch.Tensor]:
    """Full tensors of every parameter (or its .grad) of the whole model, gathered over pipeline stages, by the
    names of the bare model (activation checkpointing wraps blocks); a parameter without a gradient is left out."""
    return _over_stages({bare_name(n): local(getattr(p, attr) if attr else p).detach().cpu().clone()
                         for n, p in model.named_parameters() if getattr(p, attr or "data") is not None})


def expert_biases(model) -> dict[str, torch.Tensor]:
    return _over_stages({bare_name(n): b.detach().cpu().clone() for n, b in model.named_buffers()
                         if n.endswith("expert_bias")})


def _over_stages(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not dist.is_initialized():
        return mine
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: t for part in everyone for n, t in part.items()}


def step_and_record(tr, steps: int) -> dict:
    """Per-step losses, global grad norms and side-loss metrics (DeepSeek's mtp_loss), step-1 gradients and
    final parameters of `steps` train steps; with validation.enable, the validation loss after them."""
    losses, norms, grads, side = [], [], None, []
    for step in range(steps):
        loss, norm = train_step(tr)[:2]
        tr.progress.step += 1
        losses.append(dp_mean(loss, tr.world))
        norms.append(norm.item())
        side.append(side_loss_metrics(tr))
        if step == 0:
            grads = full_params(tr.step_parts.model, "grad")
    validation = validate_loss(tr) if tr.val_loader is not None else None
    tr.metrics.close()
    return {"losses": losses, "grad_norms": norms, "side_losses": side, "grads": grads,
            "params": full_params(tr.step_parts.model), "validation": validation}


def run_grads(argv: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        return step_and_record(_trainer(argv, steps, dump), steps)


def run_train(argv: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        tr = _trainer(argv, steps, scratch)  # a case may name its own dump folder
        samples, next_batch = {}, tr.loader.next_batch

        def recording_next_batch():
            inputs, labels = next_batch()
            rows = inputs if torch.is_tensor(inputs) else next(iter(inputs.values()))  # a family's dict: its first
            ids = [zlib.crc32(row.cpu().numpy().tobytes()) for row in rows]
            if tr.world.dims.dp > 1:
                gathered = [None] * tr.world.dims.dp
                dist.all_gather_object(gathered, ids, group=tr.world.flat["dp"].get_group())
                ids = [i for part in gathered for i in part]
            samples.setdefault(tr.progress.step + 1, []).extend(ids)
            return inputs, labels

        tr.loader.next_batch = recording_next_batch
        start = tr.progress.step
        train(tr)
        tr.metrics.close()
        return {"start": start, "losses": {h["step"]: h["loss"] for h in tr.history}, "samples": samples,
                "lrs": {h["step"]: h["lr"] for h in tr.history}, "tokens_seen": tr.progress.tokens_seen,
                "params": full_params(tr.step_parts.model), "biases": expert_biases(tr.step_parts.model),
                "history": tr.history}


def serve(queue: Path) -> None:
    """Run each job put in `queue` until a `stop` file appears (see the module docstring)."""
    rank = int(os.environ["RANK"])
    # Idle, a rank waits on its wake-up pipe (written after each job file and at the stop): polling the files,
    # the ranks of the idle pools took a tenth of a core between them.
    wake = os.open(queue / f"wake-{rank}", os.O_RDWR)  # read and write: never at end of file, a byte never lost
    for k in itertools.count():
        job = queue / f"job-{k}.pt"
        while not job.exists():
            if (queue / "stop").exists():
                shutdown(clean=True)
                return
            os.read(wake, 1)
        target, cases, steps = torch.load(job)
        torch._dynamo.reset()  # a compiled case starts cold, as in a process of its own
        try:
            module, name = target.split(":")
            fn = getattr(importlib.import_module(module), name)
            results = [fn(case, steps) for case in cases]
            release_groups()  # inside: a failure here is reported like the job's own
        except BaseException:
            (queue / f"error-{k}-{rank}.txt").write_text(traceback.format_exc())
            sys.stderr.flush()
            _tell(queue)
            os._exit(1)  # start_ranks ends the other ranks, which may wait in a collective
        if rank == 0:
            torch.save(results, queue / f"result-{k}.tmp")
            os.replace(queue / f"result-{k}.tmp", queue / f"result-{k}.pt")
            _tell(queue)


def _tell(queue: Path) -> None:
    """A byte on the pool's `done` pipe, which the test waiting for the job reads (tests/launch.py RankPool.run)."""
    try:
        fd = os.open(queue / "done", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: the pool was closed (a timeout): nobody waits
        return
    os.write(fd, b".")
    os.close(fd)


def release_groups() -> None:
    """Every process group but the world's, and what torch remembers of the job's meshes. Kept, each mesh's gloo
    groups would keep their threads polling for the rest of the run (~0.06% of a core a group, hundreds of groups);
    torch's DTensor caches key on a mesh's layout, so a later job's equal mesh would find the destroyed groups."""
    if not dist.is_initialized():
        return
    gc.collect()  # the job's trainer (reference cycles) holds its meshes, and they their groups
    dist.barrier()  # no rank still has traffic on a group another one closes
    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    world = dist.distributed_c10d._get_default_group()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    del group
    gc.collect()


def start_ranks(queue: Path, nproc: int) -> int:
    """Fork `nproc` ranks that `serve(queue)` with the environment torchrun gives (one host); when one fails, stop
    the others. The exit status: 0 when every rank ended well."""
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # What the imports made lives as long as the ranks: kept out of every collection, a rank's gc.collect (two a job,
    # release_groups) scans what its jobs made, 1 ms instead of 130.
    gc.freeze()
    ranks = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            code = 1
            try:
                serve(queue)
                code = 0
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        ranks.append(pid)
    number = {pid: rank for rank, pid in enumerate(ranks)}
    while ranks:
        ended = [os.wait()]
        # With it, the ranks that ended already: a crash that made another rank fail (its peer gone) is still a crash,
        # whichever of the two this process hears of first.
        while len(ended) < len(ranks) and (done := os.waitpid(-1, os.WNOHANG))[0]:
            ended.append(done)
        for pid, status in ended:
            ranks.remove(pid)
            if os.WIFSIGNALED(status):  # a crash (gloo's threads, rarely): tests/launch.py reruns the job on new ranks
                signame = signal.Signals(os.WTERMSIG(status)).name
                (queue / "crashed.txt").write_text(f"rank {number[pid]} died of {signame}")
        if any(status != 0 for _, status in ended):
            for other in ranks:
                os.kill(other, signal.SIGKILL)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(start_ranks(Path(sys.argv[1]), int(sys.argv[2])))
