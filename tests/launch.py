"""Run the trainer in-process (1 rank), on a pool of ranks that lives for the test run, or under torchrun (N ranks)
and read back what it computed."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tiny, fast, and fully deterministic on CPU; tests override what they vary.
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "5", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3", "--training.deterministic",
        "--training.max_norm", "0.5"]  # below the tiny model's grad norms (~0.9): every step clips


def merge(*argvs) -> list[str]:
    """Flag lists joined, a later flag replacing an earlier one of the same key (the CLI itself refuses a key
    given twice): test defaults, then what a test varies."""
    flags: dict[str, list[str]] = {}
    for argv in argvs:
        argv, i = list(argv), 0
        while i < len(argv):
            arg = argv[i]
            has_value = arg.startswith("--") and "=" not in arg and i + 1 < len(argv) \
                and not argv[i + 1].startswith("--")
            key = arg[2:].partition("=")[0] if arg.startswith("--") else f"#{len(flags)}"  # a stray word stays
            flags.pop(key, None)
            flags[key] = argv[i:i + 1 + has_value]
            i += 1 + has_value
    return [a for group in flags.values() for a in group]


def read_metrics(dump: Path) -> list[dict]:
    with open(dump / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if '"validation/' not in line]


def run_local(dump: Path, *args: str) -> list[dict]:
    """One process, in this interpreter (no torchrun start-up cost)."""
    from tessera.train import main

    env_backup = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        assert main(merge(TINY, ["--job.dump_folder", str(dump)], args)) == 0
    finally:
        os.environ.update(env_backup)
    return read_metrics(dump)


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    check_marked()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tessera.train", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_dist(nproc: int, dump: Path, *args: str) -> list[dict]:
    """The trainer (tests/dist_worker.py's run_train: build_trainer, then train) on `nproc` ranks of the pool, in
    `dump`; its metrics.jsonl. What the launch itself does is tested where it matters (signals, launchers, errors)."""
    on_ranks(nproc, "tests.dist_worker:run_train", [merge(TINY, ["--job.dump_folder", str(dump)], args)], 5)
    return read_metrics(dump)


class RanksCrashed(AssertionError):
    """A rank died of a signal (tests/dist_worker.py start_ranks), not of an error it reported: gloo's threads on
    CPU have crashed a rank (a general protection fault in pt_gloo_runloop) in a whole-suite run, between jobs."""


class RankPool:
    """`nproc` ranks that run job after job (tests/dist_worker.py's `start_ranks` and `serve`): a test pays for its
    cases, not for starting torch in every rank again."""

    def __init__(self, nproc: int):
        self.nproc, self.jobs = nproc, 0
        self.queue = Path(tempfile.mkdtemp(prefix=f"tessera-ranks{nproc}-"))
        for rank in range(nproc):  # each rank's wake-up pipe (tests/dist_worker.py's serve)
            os.mkfifo(self.queue / f"wake-{rank}")
        os.mkfifo(self.queue / "done")  # the ranks say a job ended (a result, or an error)
        self.done = os.open(self.queue / "done", os.O_RDWR | os.O_NONBLOCK)
        self.log = open(self.queue / "ranks.log", "w")
        cmd = [sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(self.queue), str(nproc)]
        self.proc = subprocess.Popen(cmd, env=_RANK_ENV, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def run(self, target: str, cases: list, steps: int, timeout: float) -> list:
        k, self.jobs = self.jobs, self.jobs + 1
        torch_save((target, cases, steps), self.queue / f"job-{k}.pt")
        self.wake()
        result, deadline = self.queue / f"result-{k}.pt", time.monotonic() + timeout
        while not result.exists():
            errors = sorted(self.queue.glob(f"error-{k}-*.txt"))
            if errors or self.proc.poll() is not None or time.monotonic() > deadline:
                try:  # a failed rank ends the pool (start_ranks), which then has said whether a rank crashed
                    self.proc.wait(timeout=30 if errors else 0.5)
                except subprocess.TimeoutExpired:
                    pass
                crash = self.queue / "crashed.txt"
                crashed = crash.exists()
                why = (crash.read_text() + "\n" if crashed else "") + "".join(
                    f"--- {e.name}\n{e.read_text()}" for e in errors) or \
                    ("the ranks exited" if self.proc.poll() is not None else f"no result after {timeout} s")
                why = f"{self.nproc} ranks, {target}: {why}\n{self.log_tail()}"
                self.close()
                raise (RanksCrashed if crashed else AssertionError)(why)
            if select.select([self.done], [], [], 1.0)[0]:  # a rank's word, or a look every second
                os.read(self.done, 4096)
        import torch

        return torch.load(result)

    def wake(self) -> None:
        """A byte to each rank waiting for a job or the stop. A rank that has not opened its pipe yet (still
        starting) looks for the job file before it waits."""
        for rank in range(self.nproc):
            try:
                fd = os.open(self.queue / f"wake-{rank}", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                continue
            os.write(fd, b".")
            os.close(fd)

    def log_tail(self, chars: int = 5000) -> str:
        return (self.queue / "ranks.log").read_text()[-chars:]

    def close(self) -> None:
        if self.log.closed:
            return
        (self.queue / "stop").touch()
        self.wake()
        os.close(self.done)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.queue, ignore_errors=True)
        self.log.close()
        if _pools.get(self.nproc) is self:
            del _pools[self.nproc]


_RANK_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # as at start: tests' setenv stay out
_pools: dict[int, RankPool] = {}
KEEP_UP_TO = 8  # ranks of a pool kept up between jobs


def may_start_ranks(marked: bool, test: str) -> None:
    """Set by tests/conftest.py before each test: whether it is marked `ranks` or `paced` (not beside another
    test's ranks)."""
    _running.update(marked=marked, test=test)


def check_marked() -> None:
    """A test that starts ranks unmarked would run beside another one's ranks on two cores: say so."""
    assert _running["marked"] or "PYTEST_XDIST_WORKER" not in os.environ, \
        f"{_running['test']} starts ranks: mark it @pytest.mark.ranks (tests/conftest.py says why)"


_running = {"marked": True, "test": ""}


def on_ranks(nproc: int, target: str, cases: list, steps: int, timeout: float = 600, fresh: bool = False) -> list:
    """target(case, steps) for each case on a pool of `nproc` ranks; what rank 0 returned, in order. `fresh`: on
    ranks that ran nothing before (a case that needs what no earlier case imported)."""
    check_marked()
    pool = _pools.get(nproc)
    if pool is None or fresh or pool.proc.poll() is not None:
        if pool is not None:
            pool.close()
        pool = _pools[nproc] = RankPool(nproc)
    try:
        try:
            return pool.run(target, cases, steps, timeout)
        except RanksCrashed as crash:  # once: a rank that crashes again fails the test
            print(f"tests.launch: {crash}\nrunning the job again on new ranks", file=sys.stderr)
            pool = _pools[nproc] = RankPool(nproc)
            try:
                return pool.run(target, cases, steps, timeout)
            except RanksCrashed as again:
                raise AssertionError(str(again)) from None
    finally:
        if nproc > KEEP_UP_TO:  # one test uses it; idle, its ranks would hold ~0.4 GiB each
            pool.close()


def close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()


def run_cases(nproc: int, cases: list[list[str]], steps: int = 5, mode: str = "grads",
              timeout: int = 600, fresh: bool = False) -> list[dict]:
    """Several training cases on `nproc` ranks (tests/dist_worker.py's run_grads or run_train)."""
    return on_ranks(nproc, f"tests.dist_worker:run_{mode}", cases, steps, timeout, fresh)


def one_process(argv: list[str], steps: int) -> dict:
    """tests/dist_worker.py's run_grads in this process, computed once per test run for each (argv, steps): the
    single-process reference that every layout compared with it shares. Callers must not change what it returns."""
    key = (tuple(merge(argv)), steps)
    if key not in _references:
        from tests.dist_worker import run_grads

        _references[key] = run_grads(argv, steps)
    return _references[key]


_references: dict[tuple, dict] = {}


def torch_save(obj, path: Path) -> None:
    """Written whole or not at all: the ranks poll for the file."""
    import torch

    torch.save(obj, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def assert_matches(got: dict, ref: dict, tol: float, what: tuple[str, ...] = ("grads",)) -> None:
    """Per-step losses and global grad norms, and step-1 gradients and/or final parameters, equal the
    reference within `tol` (relative to max(1, |ref|) for the per-step series)."""
    import torch

    for series in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(got.get(series, []), ref.get(series, []), strict=True)):
            assert abs(a - b) <= tol * max(1.0, abs(b)), f"step {step + 1}: {series} {a} vs reference {b}"
    for key in what:
        assert got[key].keys() == ref[key].keys()
        for name, g in got[key].items():
            torch.testing.assert_close(g, ref[key][name], rtol=tol, atol=tol,
                                       msg=lambda m, k=key, n=name: f"{k} {n}: {m}")


def resume_copy(src, dst, keep_through: int):
    """A copy of a finished run's dump folder that holds only checkpoints up to `keep_through`."""
    shutil.copytree(src, dst)
    for folder in (dst / "checkpoint", dst / "checkpoint" / "exports"):
        for name in os.listdir(folder) if folder.is_dir() else ():
            if name.startswith("step-") and int(name.split("-")[1]) > keep_through:
                shutil.rmtree(folder / name)
    return dst
