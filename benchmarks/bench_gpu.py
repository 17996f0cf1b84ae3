"""Llama 3 1B and 3B on one GPU, feature by feature: bf16, + compile, + selective AC, + Float8.

    python benchmarks/bench_gpu.py [--flavors 1B,3B] [--configs bf16,compile,compile_sac,compile_sac_float8]
        [--seq_len 4096] [--batch 1B=4,3B=2] [--warmup 10] [--steps 10] [--budget_s 420]
        [--out benchmarks/results/gpu.json]

Each (flavor, config) runs in its own subprocess (no compile cache or memory carried over) and prints
tokens/s, MFU against a bf16 GEMM measured in that process and against the datasheet peak, peak
allocated memory, and the peak `python -m tessera.estimate` predicts for the same config before any GPU memory is
allocated (it traces compiled blocks eagerly, so for compiled configs it is an upper bound). A config that runs
out of memory is reported as OOM. The whole run stops after --budget_s seconds (a config still running is reported
as timeout, later ones as skipped), so it fits one call of under 8 minutes.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402, I001
    AC, COMPILE, FLOAT8, RESULTS, ROOT, child_env, gemm_setup, make_trainer, sync_for, tessera_argv, timed,
    write_json,
)

CONFIGS = {"bf16": [], "compile": COMPILE, "compile_sac": COMPILE + AC["selective_op"],
           "compile_sac_float8": COMPILE + AC["selective_op"] + FLOAT8}
TAG = "RESULT "  # the child's one line of JSON


def child(a) -> dict:
    """One configuration, in this process: warm up (compilation included), then time; never raises on OOM."""
    from tessera.config import ConfigError
    from tessera.metrics import measure_gemm_peak, peak_memory_gib
    from tessera.train import train_step

    try:
        tr = make_trainer(tessera_argv(a.child[0], a.seq_len, a.batch, a.warmup + a.steps) + CONFIGS[a.child[1]])
        device = tr.world.device
        t = timed(lambda i: train_step(tr)[0], a.warmup, a.steps, sync_for(device))
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except ConfigError as e:  # e.g. float8 on a GPU older than Ada/Hopper
        return {"status": f"skipped: {e}"}
    gemm = measure_gemm_peak(device, *gemm_setup(device))
    tps = t["steps_per_s"] * a.batch * a.seq_len
    from tessera.estimate.core import estimate
    return {"status": "ok", "tokens_per_s": tps, "mfu": tps * tr.flops_per_token / gemm,
            "mfu_datasheet": tps * tr.flops_per_token / tr.peak_flops, "peak_memory_gib": peak_memory_gib(device),
            "estimate_gib": estimate(tr.cfg, tr.world.size, "cuda").peak / 2**30,
            "first_step_s": t["first_step_s"], "loss": t["loss"], "gemm_peak_tflops": gemm / 1e12}


def launch(a, flavor: str, config: str, batch: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", flavor, config, "--seq_len", str(a.seq_len), "--batch_size",
           str(batch), "--warmup", str(a.warmup), "--steps", str(a.steps)]
    env = child_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:.0f}s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith(TAG)]
    if lines:
        return json.loads(lines[-1].removeprefix(TAG))
    if "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr:
        return {"status": "OOM"}
    return {"status": "failed: " + (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", default="1B,3B")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch", default="1B=4,3B=2", help="local batch size per flavor")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (compilation happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--budget_s", type=float, default=420, help="stop after this many seconds in all")
    p.add_argument("--out", default=str(RESULTS / "gpu.json"))
    p.add_argument("--child", nargs=2, metavar=("FLAVOR", "CONFIG"), help=argparse.SUPPRESS)
    p.add_argument("--batch_size", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py: needs a CUDA GPU and none was found; on CPU run benchmarks/run_all.sh", file=sys.stderr)
        sys.exit(2)
    if a.child:
        a.batch = a.batch_size
        print(TAG + json.dumps(child(a)), flush=True)
        return

    batch = {k: int(v) for k, v in (x.split("=") for x in a.batch.split(","))}
    start, rows = time.perf_counter(), []
    print(f"{torch.cuda.get_device_name()}, seq {a.seq_len}, {a.warmup} warm-up + {a.steps} timed steps", flush=True)
    print(f"{'flavor':<6} {'config':<20} {'batch':>5} {'tokens/s':>10} {'MFU':>6} {'MFU ds':>6} {'peak GiB':>9} "
          f"{'estimate':>9} {'1st step s':>10}  status", flush=True)
    for flavor in a.flavors.split(","):
        for config in a.configs.split(","):
            left = a.budget_s - (time.perf_counter() - start)
            b = batch.get(flavor, 1)
            r = launch(a, flavor, config, b, left) if left > 60 else {"status": "skipped (time budget)"}
            rows.append({"flavor": flavor, "config": config, "batch": b, "seq_len": a.seq_len, **r})
            if r["status"] == "ok":
                print(f"{flavor:<6} {config:<20} {b:>5} {r['tokens_per_s']:>10,.0f} {r['mfu']:>6.1%} "
                      f"{r['mfu_datasheet']:>6.1%} {r['peak_memory_gib']:>9.1f} {r['estimate_gib']:>9.1f} "
                      f"{r['first_step_s']:>10.1f}  ok", flush=True)
            else:
                print(f"{flavor:<6} {config:<20} {b:>5} {'':>10} {'':>6} {'':>6} {'':>9} {'':>9} {'':>10}  "
                      f"{r['status']}", flush=True)
    write_json(a.out, {"device": torch.cuda.get_device_name(), "warmup": a.warmup, "steps": a.steps,
                       "wall_s": time.perf_counter() - start, "results": rows})


if __name__ == "__main__":
    main()
