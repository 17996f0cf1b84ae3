"""One GPU, Tessera against its peers (issue 33): Llama 3 3B and 1B at seq 8192, the same batch and step for every
peer, in bf16, + compile, + compile + Float8 (rowwise, tensorwise); then one Qwen 3 30B-A3B MoE layer.

    benchmarks/gpu_suite.sh        # the one command: carried wheels, then this script; table + results/gpu.json
    python benchmarks/bench_gpu.py [--flavors 3B,1B] [--peers tessera,plain,torchtitan,hf]
        [--configs bf16,compile,compile_float8_rowwise,compile_float8_tensorwise] [--seq_len 8192]
        [--batch 1B=3,3B=1 | auto] [--warmup 3] [--steps 6] [--budget_s 450] [--run_cap_s 150] [--resume]
        [--out benchmarks/results/gpu.json]
    python benchmarks/bench_gpu.py --smoke    # dry run on CPU: every peer that runs there, tiny model, fp32

Peers (gpu_peers.py): Tessera's trainer; a plain PyTorch loop (Tessera's model, bf16 autocast, fused AdamW,
F.cross_entropy); TorchTitan 0.2.2's own trainer (gpu_titan.py); transformers' LlamaForCausalLM (sdpa) in the plain
loop. Each run is a process of its own (no compile cache or memory carried over), stopped at its time limit.
Runs go in order of value, so a short run still answers the main question: 3B with every peer (bf16, compile), then
1B, then the Float8 configs, then the MoE layer. Every run's row is written to --out as soon as it ends; --resume
keeps the rows that are ok and runs the rest. See benchmarks/README.md for the columns.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, child_env, gemm_setup, gpu_run_options, smoke_option, write_json  # noqa: E402, I001
from gpu_titan import STEP_LINE  # noqa: E402
from gpu_peers import (  # noqa: E402
    CONFIGS, PEERS, failure, llama_args, run_child, run_hf, run_plain, run_tessera, run_titan, tessera_flags,
)

TAG = "RESULT "  # a child's one line of JSON
MAIN_CONFIGS = ("bf16", "compile")  # the main question; the Float8 ones come after both flavors
MOE_RESERVE_S = 45.0


def child(a) -> dict:
    """One run in this process: `gemm` (the ceiling), `estimate` (every prediction), or (peer, flavor, config)."""
    what = a.child
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if what[0] == "gemm":
        from tessera.metrics import measure_gemm_peak, peak_flops

        return {"gemm_flops": measure_gemm_peak(device, *gemm_setup(device), seconds=1.0),
                "datasheet_flops": peak_flops(device)[0] if device.type == "cuda" else None,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if what[0] == "estimate":
        return estimates(a)
    from tessera.config import ConfigError

    peer, flavor, config = what
    try:
        if peer == "tessera":
            res = run_tessera(flavor, config, a.seq_len, a.batch_size, a.warmup, a.steps)
        elif peer == "plain":
            res = run_plain(flavor, config, a.seq_len, a.batch_size, a.warmup, a.steps, device)
        else:
            res = run_hf(flavor, config, a.seq_len, a.batch_size, a.warmup, a.steps, device)
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except ConfigError as e:  # e.g. Float8 on a GPU before compute capability 8.9
        return {"status": f"skipped: {e}"}
    from tessera.metrics import peak_memory_gib

    return {**res, "peak_memory_gib": peak_memory_gib(device),
            "memory_kind": "max allocated" if device.type == "cuda" else "max RSS"}


def estimates(a) -> dict:
    """tessera.estimate's peak (GiB, one GPU) for every (flavor, config), traced without a GPU (Float8 emulated:
    the same tensors are kept)."""
    from common import tessera_argv

    from tessera.config import ConfigError, parse_args
    from tessera.estimate.core import estimate

    out = {}
    for flavor in a.flavors.split(","):
        for config in a.configs.split(","):
            argv = tessera_argv(flavor, a.seq_len, batch_of(a, flavor), 1) + tessera_flags(config)
            argv += ["--training.mixed_precision_param", "bfloat16"]
            if CONFIGS[config][1]:
                argv += ["--quantize.linear.float8.emulate"]
            try:
                out[f"{flavor}/{config}"] = estimate(parse_args(argv), 1, "cuda").peak / 2**30
            except ConfigError as e:
                out[f"{flavor}/{config}"] = f"refused: {e}"
    return out


def batch_of(a, flavor: str) -> int:
    return dict((k, int(v)) for k, v in (x.split("=") for x in a.batch.split(","))).get(flavor, 1)


def auto_batch(a) -> str:
    """--batch auto: per flavor the largest batch whose estimated bf16 peak fits 80% of this GPU (the eager bf16
    config keeps the most; other peers may keep more and then report OOM)."""
    from common import tessera_argv

    from tessera.config import parse_args
    from tessera.estimate.core import estimate

    limit = 0.8 * torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 8 * 2**30
    sizes = []
    for flavor in a.flavors.split(","):
        batch = 1
        while batch < 64 and estimate(parse_args(tessera_argv(flavor, a.seq_len, batch + 1, 1) + [
                "--training.mixed_precision_param", "bfloat16"]), 1, "cuda").peak <= limit:
            batch += 1
        sizes.append(f"{flavor}={batch}")
    return ",".join(sizes)


def plan(a) -> list[tuple[str, str, str]]:
    """(peer, flavor, config) in order of value: the main configs flavor by flavor, every peer; then the rest."""
    flavors, peers, configs = a.flavors.split(","), a.peers.split(","), a.configs.split(",")
    main = [c for c in configs if c in MAIN_CONFIGS]
    rest = [c for c in configs if c not in MAIN_CONFIGS]
    return [(p, f, c) for f in flavors for c in main for p in peers] + \
        [(p, f, c) for c in rest for f in flavors for p in peers]


def launch(a, peer: str, flavor: str, config: str, timeout: float) -> dict:
    batch = batch_of(a, flavor)
    if peer == "torchtitan":
        return run_titan(flavor, config, a.seq_len, batch, a.warmup, a.steps, timeout)
    cmd = [sys.executable, __file__, "--child", peer, flavor, config, "--seq_len", str(a.seq_len), "--batch_size",
           str(batch), "--warmup", str(a.warmup), "--steps", str(a.steps)]
    return parse_child(*run_child(cmd, child_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"), timeout),
                       timeout)


def parse_child(code: int | None, text: str, timeout: float) -> dict:
    lines = [x for x in text.splitlines() if x.startswith(TAG)]
    return json.loads(lines[-1].removeprefix(TAG)) if lines else failure(code, text, timeout)


def moe(a, timeout: float) -> dict:
    """bench_moe.py's layer (on CUDA: Qwen 3 30B-A3B's, bf16): grouped GEMMs against the per-expert loop."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "benchmarks/bench_moe.py"), "--ep", "", "--out", f"{tmp}/moe.json"]
        cmd += ["--smoke"] if a.smoke else []
        code, text = run_child(cmd, child_env(), timeout)
        if code == 0:
            return {"status": "ok", **json.loads(Path(tmp, "moe.json").read_text())["layer"]}
    return parse_child(code, text, timeout)


def row_text(r: dict, fpt: float, gemm: dict, base: dict | None) -> str:
    head = f"{r['flavor']:<10} {r['config']:<26} {r['peer']:<10} {r['batch']:>5}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status', '')}"
    tps = r["tokens_per_s"]
    ds = f"{tps * fpt / gemm['datasheet_flops']:>6.1%}" if gemm.get("datasheet_flops") else f"{'-':>6}"
    est = r.get("estimate_gib")
    vs = f"{tps / base['tokens_per_s']:>6.2f}x" if base and base.get("status") == "ok" else f"{'':>7}"
    return (f"{head} {tps:>10,.0f} {vs} {tps * fpt / gemm['gemm_flops']:>6.1%} {ds} {r['peak_memory_gib']:>8.1f} "
            f"{est if isinstance(est, float) else float('nan'):>8.1f} {r.get('first_step_s') or 0:>8.1f}  ok")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", default="3B,1B", help="in order of value")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--batch", default="1B=3,3B=1", help="local batch per flavor, the same for every peer; auto: the "
                   "largest whose estimated bf16 peak fits 80%% of the GPU (1B=3, 3B=1 on a 141 GB H200)")
    p.add_argument("--no_moe", action="store_true", help="leave out the MoE layer")
    gpu_run_options(p, budget_s=450, run_cap_s=150, out=RESULTS / "gpu.json")
    p.add_argument("--batch_size", type=int, help=argparse.SUPPRESS)
    smoke_option(p, flavors="debugmodel", configs="bf16", seq_len=64, batch="debugmodel=2", warmup=1, steps=2,
                 budget_s=240, run_cap_s=120)
    a = p.parse_args()
    if a.child:
        print(TAG + json.dumps(child(a)), flush=True)
        return
    if not torch.cuda.is_available() and not a.smoke:
        print("bench_gpu.py: needs a CUDA GPU and none was found; --smoke runs it on CPU with a tiny model",
              file=sys.stderr)
        sys.exit(2)
    suite(a)


def suite(a) -> None:
    from tessera.models import family

    start = time.perf_counter()
    if a.batch == "auto":
        a.batch = auto_batch(a)
    done, earlier = {}, {}
    if a.resume and Path(a.out).exists():
        earlier = json.loads(Path(a.out).read_text())
        done = {(r["peer"], r["flavor"], r["config"]): r for r in earlier["results"] if r.get("status") == "ok"}
    # The predictions are traced on the CPU meanwhile, in a process that sees no GPU.
    est_cmd = [sys.executable, __file__, "--child", "estimate", "--flavors", a.flavors, "--configs", a.configs,
               "--seq_len", str(a.seq_len), "--batch", a.batch]
    est_proc = subprocess.Popen(est_cmd, env=child_env(CUDA_VISIBLE_DEVICES=""), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    gemm = parse_child(*run_child([sys.executable, __file__, "--child", "gemm"], child_env(), 60), 60)
    fpt = {f: family("llama3").counts(llama_args(f, a.seq_len, 256), a.seq_len).flops_per_token
           for f in a.flavors.split(",")}
    doc = {"device": gemm.get("device"), "torch": gemm.get("torch"), "seq_len": a.seq_len, "batch": a.batch,
           "warmup": a.warmup, "steps": a.steps, "gemm_tflops": gemm["gemm_flops"] / 1e12,
           "datasheet_tflops": (gemm.get("datasheet_flops") or 0) / 1e12, "flops_per_token": fpt, "results": []}
    print(f"{doc['device']}, torch {doc['torch']}, seq {a.seq_len}, batch {a.batch}, {a.warmup} warm-up + "
          f"{a.steps} timed steps; measured GEMM {doc['gemm_tflops']:.3g} TFLOP/s, datasheet "
          f"{doc['datasheet_tflops'] or 'n/a'}", flush=True)
    print(f"{'flavor':<10} {'config':<26} {'peer':<10} {'batch':>5} {'tokens/s':>10} {'vs tes':>7} {'MFU':>6} "
          f"{'MFU ds':>6} {'peak GiB':>8} {'estimate':>8} {'1st s':>8}  status", flush=True)
    reserve = 0.0 if a.no_moe else (MOE_RESERVE_S if not a.smoke else 30.0)
    titan_broken = None  # TorchTitan failed before its first step: it will not run in this environment
    for peer, flavor, config in plan(a):
        left = a.budget_s - (time.perf_counter() - start) - reserve
        row = {"peer": peer, "flavor": flavor, "config": config, "batch": batch_of(a, flavor), "seq_len": a.seq_len}
        if (peer, flavor, config) in done:
            row = done[(peer, flavor, config)] | {"resumed": True}
        elif peer == "torchtitan" and titan_broken:
            row["status"] = f"skipped: TorchTitan failed before its first step above ({titan_broken[:120]})"
        else:
            row |= launch(a, peer, flavor, config, min(left, a.run_cap_s)) if left > 40 else \
                {"status": "skipped (time budget)"}
            if peer == "torchtitan" and row["status"].startswith("failed") and \
                    not STEP_LINE.search(row.get("log_tail", "")):
                titan_broken = row["status"]
        doc["results"].append(row)
        base = next((r for r in doc["results"] if r["peer"] == "tessera" and r["flavor"] == flavor
                     and r["config"] == config), None)
        print(row_text(row, fpt[flavor], gemm, base if peer != "tessera" else None), flush=True)
        write_json(a.out, doc, quiet=True)
    if not a.no_moe:
        done_moe = earlier.get("moe", {}).get("status") == "ok"
        doc["moe"] = earlier["moe"] if done_moe else moe(a, max(20.0, a.budget_s - (time.perf_counter() - start)))
        m = doc["moe"]
        print(f"MoE layer ({m.get('dim')} wide, {m.get('experts')} experts top {m.get('top_k')}, {m.get('tokens')} "
              f"tokens, fwd + bwd): grouped {m.get('grouped_tokens_s', 0):,.0f} tokens/s, loop "
              f"{m.get('loop_tokens_s', 0):,.0f}, grouped / loop {m.get('grouped_over_loop', 0):.2f}x  "
              f"{m['status']}" if m["status"] == "ok" else f"MoE layer: {m['status']}", flush=True)
    try:
        predicted = json.loads(est_proc.communicate(timeout=120)[0].splitlines()[-1].removeprefix(TAG))
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
        est_proc.kill()
        predicted = {}
    for row in doc["results"]:
        row["estimate_gib"] = predicted.get(f"{row['flavor']}/{row['config']}")
    doc["wall_s"] = time.perf_counter() - start
    write_json(a.out, doc)
    print("estimate: tessera.estimate's predicted peak for Tessera's run (GiB); peak GiB: max allocated "
          "(TorchTitan: max reserved)")
    for row in doc["results"]:
        if row.get("status") == "ok":
            print(f"  {row['flavor']:<10} {row['config']:<26} {row['peer']:<10} peak {row['peak_memory_gib']:6.1f}"
                  f"  estimate {row['estimate_gib'] if isinstance(row['estimate_gib'], float) else float('nan'):6.1f}")
    failed = [r for r in [*doc["results"], doc.get("moe", {})] if r.get("status", "").startswith("failed")]
    if a.smoke and failed:  # on CPU every run that starts must finish: a failure is a broken benchmark
        sys.exit(f"bench_gpu.py --smoke: {len(failed)} run(s) failed: {failed[0]['status']}")


if __name__ == "__main__":
    main()
