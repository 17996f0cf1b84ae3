"""Fault tolerance (tessera/ft) side by side with the same job without it, in one run on this machine.

    python benchmarks/bench_ft.py [--flavor debugmodel] [--seq_len 128] [--steps 100] [--kill_at 15]
        [--semi_steps 200] [--smoke] [--out benchmarks/results/ft.json]

(a) Overhead with no failure (--overhead_steps each): 2 replica groups of 1 process under fault tolerance (a
    lighthouse, a quorum and a commit vote per step, gradients averaged over the groups in buckets) against DDP 2
    (data_parallel_replicate 2, one torchrun launch) without it; the median seconds per step of each (the first
    steps, warming up, left out).
(b) Work lost to one failure, SIGKILL at step --kill_at:
    - fault tolerance: group 1 is killed and relaunched at once; group 0 never stops. Reported: the steps group 0
      ran again (not committed when its peer died), the seconds its steps around the failure took beyond the
      median, and for group 1 the seconds from relaunch to recovered (start-up included) and of the transfer.
    - checkpoint restart: the DDP 2 job is killed and relaunched; it resumes from its last checkpoint (interval
      10). Reported: the steps it trains again and the seconds from the kill until it is back at the step it had
      reached.
(c) Semi-synchronous groups (--semi_steps each, 2 groups of 1 process, the three jobs at once, each with its own
    lighthouse): per-step groups against DiLoCo syncing every 5 and every 20 steps, after the same tokens: the
    validation loss at the end (after the last sync, the mean of the two groups' held-out shares), the MB each rank
    sent to the other group, the bytes per token trained, and the seconds spent in quorums and syncs.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, smoke_option, write_json  # noqa: E402, I001

from tests import replica_groups as local  # noqa: E402  (the replica groups the tests start, on this machine)


def step_seconds(rows: list[dict], seq_len: int, batch: int) -> dict[int, float]:
    """Seconds of each logged step (log_freq 1): the tokens of one step over its tokens/s."""
    return {r["step"]: seq_len * batch / r["tps"] for r in rows}


def torchrun(argv: list[str], log: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "tessera.train", *argv]
    return local.start_process(cmd, log)


def finish(proc, timeout: float = 600) -> None:
    proc.wait(timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"bench_ft: a run failed:\n{proc.log.read_text()[-3000:]}")


def semi_sync(a, base: list[str], tmp: Path) -> list[dict]:
    """(c): one row per method, in one run."""
    methods = [("every step", []), *((f"diloco/{n}", ["--fault_tolerance.semi_sync_method", "diloco",
                                                       "--fault_tolerance.sync_steps", str(n)]) for n in (5, 20))]
    evaluate = ["--training.steps", str(a.semi_steps), "--validation.enable", "--validation.freq", str(a.semi_steps)]
    servers = [local.start_lighthouse() for _ in methods]
    jobs = []
    try:
        for (name, flags), (_, address) in zip(methods, servers, strict=True):
            dump = tmp / name.replace(" ", "_").replace("/", "_")
            argv = [*base, *evaluate, *flags, "--job.dump_folder", str(dump)]
            jobs.append((name, dump, [local.start_single([*argv, *local.ft_flags(address, i, 2, 2)],
                                                         tmp / f"{dump.name}{i}.log") for i in range(2)]))
        for _, _, procs in jobs:
            for proc in procs:
                finish(proc)
    finally:
        for server, _ in servers:
            server.shutdown()
    rows = []
    for name, dump, _ in jobs:
        last = [local.rows(dump / f"replica_{i}")[-1] for i in range(2)]
        validation = [r["validation/loss"] for i in range(2) for r in map(json.loads, (
            dump / f"replica_{i}" / "metrics.jsonl").read_text().splitlines()) if "validation/loss" in r]
        rows.append({"method": name, "validation_loss": sum(validation) / len(validation), "syncs": last[0]["ft/syncs"],
                     "mb_sent_per_rank": last[0]["ft/sync_mb"], "bytes_per_token": last[0]["ft/sync_bytes_per_token"],
                     "sync_s": last[0]["ft/sync_s"], "tokens_per_group": a.semi_steps * a.batch * a.seq_len})
    for row in rows:
        row["bytes_vs_every_step"] = row["mb_sent_per_rank"] / rows[0]["mb_sent_per_rank"]
    return rows


def failures(a, result: dict, base: list[str], short: list[str], tmp: Path) -> None:
    """(a) and (b), into `result`."""
    server, address = local.start_lighthouse()
    warm = min(3, a.overhead_steps // 3)
    try:
        # (a) no failure
        ddp = torchrun([*short, "--job.dump_folder", str(tmp / "ddp"), "--parallelism.data_parallel_replicate_degree",
                        "2"], tmp / "ddp.log")
        finish(ddp)
        groups = [local.start_single([*short, "--job.dump_folder", str(tmp / "ft"),
                                      *local.ft_flags(address, i, 2, 2)], tmp / f"ft{i}.log") for i in range(2)]
        for proc in groups:
            finish(proc)
        plain = step_seconds(local.rows(tmp / "ddp"), a.seq_len, a.batch)
        ft = step_seconds(local.rows(tmp / "ft" / "replica_0"), a.seq_len, a.batch)
        plain_s = statistics.median(v for k, v in plain.items() if k > warm)
        ft_s = statistics.median(v for k, v in ft.items() if k > warm)
        result["overhead"] = {"ddp2_step_s": plain_s, "ft_2_groups_step_s": ft_s, "ft_over_ddp": ft_s / plain_s}

        # (b) one failure under fault tolerance: group 1 killed at kill_at, relaunched at once
        dump = tmp / "ft_fail"
        flags = [local.ft_flags(address, i, 2, 1) for i in range(2)]
        # Slower steps (tests/faults.py), so that the kill lands mid-run.
        delay = {"program": (str(local.ROOT / "tests/faults.py"),), "TESSERA_TEST_STEP_SECONDS": str(a.step_delay)}
        groups = [local.start_single([*base, "--job.dump_folder", str(dump), *flags[i]], tmp / f"fail{i}.log",
                                     **delay) for i in range(2)]
        local.wait_for("kill step", lambda: len(local.rows(dump / "replica_1")) >= a.kill_at, groups, 600)
        local.kill(groups[1])
        relaunched = time.monotonic()
        before = len(local.rows(dump / "replica_1"))
        groups[1] = local.start_single([*base, "--job.dump_folder", str(dump), *flags[1]], tmp / "fail1b.log",
                                       **delay)
        rejoined = None
        while groups[0].poll() is None or groups[1].poll() is None:
            if rejoined is None and len(local.rows(dump / "replica_1")) > before:
                rejoined = time.monotonic() - relaunched
            time.sleep(0.05)
        for proc in groups:
            finish(proc)
        survivor = local.rows(dump / "replica_0")
        seconds = step_seconds(survivor, a.seq_len, a.batch)
        typical = statistics.median(seconds.values())
        back = local.rows(dump / "replica_1")[before:]
        result["ft_failure"] = {
            "survivor_steps_recomputed": survivor[-1]["ft/uncommitted_steps"],
            "survivor_stall_s": sum(max(0.0, s - typical) for k, s in seconds.items() if k > warm),
            "survivor_degraded_steps": survivor[-1]["ft/degraded_steps"],
            "rejoin_s_from_relaunch": rejoined,
            "recovered_from_peer": bool(back and back[0]["ft/recoveries"]),
            "recovery_transfer_s": back[0]["ft/recovery_s"] if back else None,
            "step_delay_s": a.step_delay,
            "killed_group_steps_missed": (back[0]["step"] - before) if back else None}

        # (b) the same failure without fault tolerance: kill the job, restart from its last checkpoint
        dump = tmp / "ckpt"
        ckpt = [*base, "--job.dump_folder", str(dump), "--parallelism.data_parallel_replicate_degree", "2",
                "--checkpoint.enable", "--checkpoint.interval", str(a.interval)]
        job = torchrun(ckpt, tmp / "ckpt1.log")
        local.wait_for("kill step", lambda: len(local.rows(dump)) >= a.kill_at, [job], 600)
        local.kill(job)
        killed, reached = time.monotonic(), local.rows(dump)[-1]["step"]
        job = torchrun(ckpt, tmp / "ckpt2.log")
        local.wait_for("back at the kill step", lambda: local.rows(dump)[-1]["step"] >= reached
                       and len(local.rows(dump)) > reached, [job], 600)
        back_s = time.monotonic() - killed
        finish(job)
        resumed = (reached // a.interval) * a.interval
        result["checkpoint_restart"] = {"steps_recomputed": reached - resumed, "seconds_to_recover": back_s,
                                        "killed_at_step": reached, "resumed_from_step": resumed}
    finally:
        server.shutdown()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kill_at", type=int, default=15)
    p.add_argument("--interval", type=int, default=10, help="checkpoint interval of the restart side")
    p.add_argument("--step_delay", type=float, default=0.1, help="seconds added to each step of the fault-tolerant "
                   "failure run, so that the survivor is still training when the killed group is back")
    p.add_argument("--overhead_steps", type=int, default=40, help="steps of each run of (a)")
    p.add_argument("--semi_steps", type=int, default=200, help="steps of each run of (c)")
    p.add_argument("--semi_only", action="store_true", help="run (c) alone")
    p.add_argument("--out", default=str(RESULTS / "ft.json"))
    smoke_option(p, flavor="tiny", seq_len=32, steps=120, kill_at=7, interval=5, overhead_steps=15, semi_steps=20)
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tessera-bench-ft-"))
    common = ["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len), "--training.local_batch_size",
              str(a.batch), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "1e-3"]
    base, short = [*common, "--training.steps", str(a.steps)], [*common, "--training.steps", str(a.overhead_steps)]
    result: dict = {"flavor": a.flavor, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps}
    if not a.semi_only:
        failures(a, result, base, short, tmp)
    result["semi_sync"] = semi_sync(a, common, tmp)
    for key, value in result.items():
        print(f"{key}: {value}")
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
