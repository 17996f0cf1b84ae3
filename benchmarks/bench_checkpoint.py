"""What checkpoint checksums cost: DCP save and load of the same state with and without them, side by side.

    python benchmarks/bench_checkpoint.py [--mb 384] [--rounds 5] [--fsync] [--smoke]
        [--out benchmarks/results/checkpoint.json]

The state is a model's and its Adam moments' worth of fp32 tensors (`--mb` in all) plus the small pickled train
state, as the trainer saves it. "plain": DCP's FileSystemWriter and a marker of sizes (what Tessera wrote before);
"checksummed": tessera.checkpoint.writer.HashingWriter (xxh3_64 of every file as its bytes are written) and the
marker with digests. Load: dcp.load alone vs the content check of every file (tessera.checkpoint.folder.verify)
then dcp.load. The two alternate round by round in one folder; the medians are compared. Without `--fsync` the
files are not synced to disk (the trainer syncs them): the time is then the CPU's (serializing, copying to the page
cache, hashing), which a shared disk's flush times would otherwise drown. Files are read back from
the page cache here, so the load ratio is the check's CPU cost; from a cold network file system the check's
extra read costs what reading the checkpoint costs (the ranks share it: each file is read by one rank).
"""

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_json  # noqa: E402, I001

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from tessera.checkpoint.folder import read_marker, verify, write_marker  # noqa: E402
from tessera.checkpoint.writer import HashingWriter  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_state(total_mb: float) -> dict:
    """Weights and two Adam moments (each a third of `total_mb`) in 4 MiB-ish tensors, and a train-state blob."""
    rows = max(1, int(total_mb * 2**20 / 3 / 4) // 1024)  # of 1024 fp32 per part
    chunk = 1024  # rows per tensor: 4 MiB
    gen = torch.Generator().manual_seed(0)

    def part() -> dict:
        return {f"layer{i}": torch.randn(min(chunk, rows - i * chunk), 1024, generator=gen)
                for i in range((rows + chunk - 1) // chunk)}
    blob = io.BytesIO()
    torch.save({"step": 1, "rng": torch.get_rng_state()}, blob)
    return {"model": part(), "optimizer": {"exp_avg": part(), "exp_avg_sq": part()}, "train": blob}


def clocks() -> tuple[float, float]:
    """(wall, this process's CPU) seconds: on a shared machine the CPU time is the steadier measure."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    return tuple(now - then for now, then in zip(clocks(), start, strict=True))


def save(state: dict, path: str, checksums: bool, fsync: bool) -> tuple[float, float]:
    shutil.rmtree(path, ignore_errors=True)
    start = clocks()
    if checksums:
        writer = HashingWriter(path, sync_files=fsync)
        dcp.save(state, storage_writer=writer)
        write_marker(path, 1, "full", writer.digests)
    else:
        dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=fsync))
        files = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}
        with open(os.path.join(path, ".complete"), "w") as fh:  # the marker as it was: sizes only
            json.dump({"step": 1, "kind": "full", "files": files}, fh)
    return since(start)


def load(state: dict, path: str, checksums: bool) -> tuple[float, float]:
    target = {k: v for k, v in state.items() if k != "train"} | {"train": io.BytesIO()}
    start = clocks()
    if checksums:
        verify(path, read_marker(path))
    dcp.load(target, checkpoint_id=path)
    return since(start)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=384, help="state size in MiB (weights + 2 Adam moments)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fsync", action="store_true", help="sync the files to disk, as the trainer does")
    p.add_argument("--smoke", action="store_true", help="a tiny state, one round: checks the script runs")
    p.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = p.parse_args(argv)
    if a.smoke:
        a.mb, a.rounds = 8, 1
    torch.set_num_threads(1)
    state = make_state(a.mb)
    size = sum(t.numel() * t.element_size() for part in (state["model"], *state["optimizer"].values())
               for t in part.values())
    names = [f"{op}_{kind}" for op in ("save", "load") for kind in ("plain", "checksum")]
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="tessera-bench-ckpt-") as tmp:
        for r in range(a.rounds + 1):  # round 0 warms up (allocations, the page cache), untimed
            for checksums in ((False, True) if r % 2 else (True, False)):
                kind = "checksum" if checksums else "plain"
                path = os.path.join(tmp, kind)
                saved = save(state, path, checksums, a.fsync)
                for op, (w, c) in (("save", saved), ("load", load(state, path, checksums))):
                    if r:
                        wall[f"{op}_{kind}"].append(w)
                        cpu[f"{op}_{kind}"].append(c)
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    med = {k: statistics.median(v) for k, v in cpu.items()}
    result = {"state_mib": size / 2**20, "rounds": a.rounds, "fsync": a.fsync, "median_cpu_s": med,
              "median_wall_s": med_wall, "cpu_s": cpu, "wall_s": wall,
              # the checksums' cost, as a share of a plain save: CPU time, then wall time
              "save_ratio": med["save_checksum"] / med["save_plain"],
              "load_ratio": med["load_checksum"] / med["load_plain"],
              "load_check_share_of_save": (med["load_checksum"] - med["load_plain"]) / med["save_plain"],
              "save_ratio_wall": med_wall["save_checksum"] / med_wall["save_plain"],
              "load_ratio_wall": med_wall["load_checksum"] / med_wall["load_plain"]}
    print(f"state {size / 2**20:.0f} MiB, median of {a.rounds} round(s), files {'' if a.fsync else 'not '}synced")
    print(f"{'':6} {'CPU plain':>10} {'checksum':>9} {'ratio':>6}   {'wall plain':>10} {'checksum':>9} {'ratio':>6}")
    for op in ("save", "load"):
        print(f"{op:6} {med[f'{op}_plain']:9.3f}s {med[f'{op}_checksum']:8.3f}s {result[f'{op}_ratio']:6.3f}   "
              f"{med_wall[f'{op}_plain']:9.3f}s {med_wall[f'{op}_checksum']:8.3f}s {result[f'{op}_ratio_wall']:6.3f}")
    print(f"the load-time check costs {result['load_check_share_of_save']:.1%} of a plain save (CPU)")
    write_json(a.out, result)
    return result


if __name__ == "__main__":
    main()
