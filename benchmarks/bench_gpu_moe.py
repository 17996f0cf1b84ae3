"""One GPU, experts and attention kernels in training (issue 43), in one command that stops starting runs after
~7 minutes and writes benchmarks/results/gpu_moe.json after every measurement:

    benchmarks/gpu_moe.sh                      # carried wheels (benchmarks/gpu_wheels.sh), then this script
    python benchmarks/bench_gpu_moe.py [--layers qwen3_30b_a3b,deepseek_v3_16b] [--tokens 16384]
        [--deltanet_seqs 4096,16384,65536] [--chunk_size 64]
        [--steps_runs gpt_oss:flex,...,qwen3_5:torch,qwen3_5:fla] [--n_layers gpt_oss=6,llama4=2]
        [--budget_s 420] [--run_cap_s 120] [--resume] [--out benchmarks/results/gpu_moe.json]
    python benchmarks/bench_gpu_moe.py --smoke  # dry run on CPU: tiny layer, kernels and models, fp32, no compile

1. MoE layers (gpu_moe_layer.py), forward + backward in bf16: Qwen 3 30B-A3B's (2048 wide, 128 experts, top 8)
   and DeepSeek V3 16B's (2048 wide, 64 experts, top 6, 2 shared): Tessera's grouped experts, its per-expert
   loop, TorchTitan's MoE module (0.2.2, if installed), and both grouped ones with torchao's Float8 rowwise
   grouped GEMMs. Targets: Tessera >= TorchTitan, grouped >= 3x the loop.
2. Training steps with FlexAttention: Tessera's trainer (compiled blocks, bf16, AdamW) on GPT-OSS 20b cut to its
   first blocks (sliding windows of 128 + sinks, alternating with full attention) and Llama 4 Scout cut to its
   first blocks (chunked attention, chunks of 8192: the sequence is 16384), each with FlexAttention (`attend`'s
   CUDA path) and with the materialized scores (`attention.use_attention` gives the run's model those);
   tokens/s, MFU (the family's FLOPs per token / the datasheet peak) and peak memory against `tessera.estimate`.
3. Gated DeltaNet (gpu_deltanet.py), forward + backward of the chunked delta rule at Qwen 3.5 9B's shape, at each
   of --deltanet_seqs tokens: Tessera's torch path against fla's Triton kernel (fla-core, if installed): tokens/s,
   peak memory, and fla's output and gradients against the torch path's within bf16 tolerance. Then training
   steps of the Qwen 3.5 debug model (seq 4096 x 4, eager: see EAGER) with `[qwen3_5] kernel` torch and fla.

Each layer, kernel length and training step is a process of its own, killed at --run_cap_s; a run that runs out
of memory is `OOM` (the materialized attention is expected to, where it does not fit).
"""

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402, I001
    COMPILE, RESULTS, child_env, gpu_run_options, make_trainer, smoke_option, tessera_argv, write_json,
)
import gpu_deltanet  # noqa: E402
from gpu_moe_layer import LAYERS, SMOKE_LAYER, VARIANTS, measure  # noqa: E402
from gpu_peers import failure, median_timing, run_child  # noqa: E402

TAG = "RESULT "  # a child's lines of JSON: [key, value]
# name: (family, flavor, blocks kept, seq_len, local batch): as many blocks as tessera.estimate's peak keeps under
# 100 GiB, 72% of the H200 (a margin for the estimate's error; the published vocabularies kept): GPT-OSS 20b 6
# blocks 96.3 GiB (7: 109.4), Llama 4 Scout 2 blocks 97.5 GiB (1: 64.7)
STEP_MODELS = {"gpt_oss": ("gpt_oss", "20b", 6, 4096, 2), "llama4": ("llama4", "17bx16e", 2, 16384, 1)}
STEP_MODELS["qwen3_5"] = ("qwen3_5", "debugmodel", 0, 4096, 4)
SMOKE_MODELS = {"gpt_oss": ("gpt_oss", "debugmodel", 0, 64, 2), "llama4": ("llama4", "debugmodel", 0, 64, 2),
                "qwen3_5": ("qwen3_5", "tiny", 0, 64, 2)}
# Not compiled: the torch path's loop over chunks unrolls into each block's graph (64 steps at seq 4096), and fla's
# Triton kernels are compiled by Triton already; the step measures the kernels, as the eager family runs them.
EAGER = {"qwen3_5"}
DELTANET_KERNELS = ("torch", "fla")  # a step's kernel: the family's `kernel` option


def emit(key: str, value) -> None:
    print(TAG + json.dumps([key, value]), flush=True)


def child_layer(a) -> None:
    family, flavor = SMOKE_LAYER if a.smoke else LAYERS[a.child[1]]
    measure(family, flavor, a.tokens, a.warmup, a.steps, emit)


def reduced_flavor(family: str, flavor: str, n_layers: int) -> str:
    """`flavor` cut to its first `n_layers` blocks, added to the family's table in this process only (0: as is)."""
    from tessera.models import family as fam

    if not n_layers:
        return flavor
    table = fam(family).flavors
    name = f"{flavor}_{n_layers}blocks"
    table[name] = dataclasses.replace(table[flavor], n_layers=n_layers)
    return name


def child_deltanet(a) -> None:
    gpu_deltanet.measure(int(a.child[1]), a.chunk_size, a.warmup, a.steps, a.smoke, emit)


def child_step(a) -> None:
    """One training step run: (model, kernel) with Tessera's trainer; its estimate first (CPU work)."""
    from tessera.config import ConfigError
    from tessera.estimate.core import estimate
    from tessera.metrics import peak_flops, peak_memory_gib
    from tessera.models import family as fam
    from tessera.models.common import attention
    from tessera.schema import parse_args  # the families' sections included ([qwen3_5] kernel)
    from tessera.train import train_step

    model, kernel = a.child[1], a.child[2]
    family, flavor, n_layers, seq_len, batch = (SMOKE_MODELS if a.smoke else STEP_MODELS)[model]
    n_layers = dict((k, int(v)) for k, v in (x.split("=") for x in a.n_layers.split(",") if x)).get(model, n_layers)
    flavor = reduced_flavor(family, flavor, n_layers)
    cuda = torch.cuda.is_available()
    compiled = cuda and family not in EAGER
    argv = ["--model.name", family] + tessera_argv(flavor, seq_len, batch, a.warmup + a.steps) + \
        (COMPILE if compiled else []) + \
        ([f"--{family}.kernel", kernel, f"--{family}.chunk_size", str(a.chunk_size)] if kernel in DELTANET_KERNELS
         else [])
    args = fam(family).flavors[flavor]
    emit("config", {"family": family, "flavor": flavor, "blocks": args.n_layers, "seq_len": seq_len, "batch": batch,
                    "kernel": kernel, "compiled": compiled})
    try:
        emit("estimate_gib", estimate(parse_args(argv), 1, "cuda").peak / 2**30)
    except ConfigError as e:
        emit("estimate_gib", f"refused: {e}")
    except Exception as e:  # noqa: BLE001 - the run is measured all the same
        emit("estimate_gib", f"failed: {type(e).__name__}: {str(e)[:300]}")
    if cuda:  # the run's peak from here on
        torch.cuda.reset_peak_memory_stats()
    device = torch.device("cuda" if cuda else "cpu")
    tr = make_trainer(argv)
    if kernel == "materialized":  # the scores as a tensor: every layer's kernel, before its first (compiled) step
        from check_flex_gpu import materialized
        attention.use_attention(tr.step_parts.model, materialized)
    res = median_timing(lambda i: train_step(tr)[0], a.warmup, a.steps, torch.cuda.synchronize if cuda else
                        (lambda: None), batch * seq_len)
    fpt = fam(family).counts(dataclasses.replace(args, max_seq_len=seq_len), seq_len).flops_per_token
    res |= {"flops_per_token": fpt, "peak_memory_gib": peak_memory_gib(device),
            "memory_kind": "max allocated" if cuda else "max RSS"}
    if cuda:
        res["mfu_datasheet"] = res["tokens_per_s"] * fpt / peak_flops(device)[0]
    emit("result", res)


def read_child(code, text: str, timeout: float) -> dict:
    """The child's [key, value] lines as a dict; a failure's status when it printed no result."""
    out = {}
    for line in text.splitlines():
        if line.startswith(TAG):
            key, value = json.loads(line.removeprefix(TAG))
            out[key] = value
    if code == 0:
        return {"status": "ok", **out}
    why = failure(code, text, timeout)
    return {**out, "status": why["status"], **({"log_tail": why["log_tail"]} if "log_tail" in why else {})}


def launch(a, what: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", *what, "--tokens", str(a.tokens), "--warmup", str(a.warmup),
           "--steps", str(a.steps), "--n_layers", a.n_layers, "--chunk_size", str(a.chunk_size)] + \
        (["--smoke"] if a.smoke else [])
    return read_child(*run_child(cmd, child_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"), timeout),
                      timeout)


def variant_text(name: str, row: dict) -> str:
    if row.get("status") != "ok":
        return f"{name}: {row.get('status', 'not run')}"
    return f"{name} {row['tokens_per_s']:,.0f} tok/s" + (f" {row['peak_gib']:.2f} GiB" if row["peak_gib"] else "")


def layer_line(name: str, r: dict) -> str:
    """The layer's variants and their ratios (stored in `r` too)."""
    ratios = []
    for num, den, label in (("tessera_grouped", "loop", "grouped/loop"), ("tessera_grouped", "torchtitan",
                            "tessera/titan"), ("tessera_grouped_float8", "tessera_grouped", "float8/bf16")):
        if r.get(num, {}).get("status") == r.get(den, {}).get("status") == "ok":
            r[f"{num}_over_{den}"] = r[num]["tokens_per_s"] / r[den]["tokens_per_s"]
            ratios.append(f"{label} {r[f'{num}_over_{den}']:.2f}x")
    rows = "; ".join(variant_text(v, r.get(v, {})) for v in VARIANTS)
    return f"MoE layer {name}: {r.get('status')}: {rows}" + ("  |  " + ", ".join(ratios) if ratios else "")


def deltanet_line(name: str, r: dict) -> str:
    """Both kernels at one length, fla's speed-up and its agreement with the torch path (stored in `r` too)."""
    rows = "; ".join(variant_text(k, r.get(k, {})) for k in DELTANET_KERNELS)
    if r.get("torch", {}).get("status") == r.get("fla", {}).get("status") == "ok":
        r["fla_over_torch"] = r["fla"]["tokens_per_s"] / r["torch"]["tokens_per_s"]
        rows += f"  |  fla/torch {r['fla_over_torch']:.2f}x"
    if "fla_vs_torch" in r:
        e = r["fla_vs_torch"]
        rows += f", {'equal' if e['equal'] else 'NOT equal'} (largest rel. error {e['max']:.1e}, tol {e['tolerance']})"
    return f"Gated DeltaNet {name}: {r.get('status')}: {rows}"


def skipped(what: list[str]) -> str | None:
    """Why a run need not start: a training step with fla's kernels where they cannot run."""
    if what[0] == "step" and what[2] == "fla":
        return gpu_deltanet.fla_missing(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return None


def step_line(name: str, r: dict) -> str:
    res = r.get("result")
    if not res:
        est = f"  (estimate {r['estimate_gib']})" if "estimate_gib" in r else ""
        return f"step {name}: {r.get('status', 'no result')}{est}"
    mfu = f", MFU {res['mfu_datasheet']:.1%}" if "mfu_datasheet" in res else ""
    est = r.get("estimate_gib")
    return (f"step {name} ({r['config']['blocks']} blocks, seq {r['config']['seq_len']} x {r['config']['batch']}): "
            f"{res['tokens_per_s']:,.0f} tok/s{mfu}, first step {res['first_step_s']:.1f} s, peak "
            f"{res['peak_memory_gib']:.1f} GiB, estimate {est if isinstance(est, str) else f'{est:.1f} GiB'}")


def suite(a) -> None:
    start = time.perf_counter()
    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "torchtitan": None, "torchao": None, "fla-core": None, "layers": {}, "deltanet": {}, "steps": {}}
    for pkg in ("torchtitan", "torchao", "fla-core"):
        if importlib.util.find_spec(pkg.removesuffix("-core")):
            from importlib.metadata import PackageNotFoundError, version
            try:
                doc[pkg] = version(pkg)
            except PackageNotFoundError:
                doc[pkg] = "unknown"
    earlier = json.loads(Path(a.out).read_text()) if a.resume and Path(a.out).exists() else {}
    print(f"{doc['device']}, torch {doc['torch']}, torchtitan {doc['torchtitan']}, torchao {doc['torchao']}, "
          f"fla-core {doc['fla-core']}", flush=True)
    runs = [("layers", name, ["layer", name]) for name in a.layers.split(",") if name] + \
        [("deltanet", f"seq{n}", ["deltanet", n]) for n in a.deltanet_seqs.split(",") if n] + \
        [("steps", spec, ["step", *spec.split(":")]) for spec in a.steps_runs.split(",") if spec]
    lines = {"layers": layer_line, "deltanet": deltanet_line, "steps": step_line}
    for section, name, what in runs:
        left = a.budget_s - (time.perf_counter() - start)
        done = earlier.get(section, {}).get(name, {})
        if done and (done.get("result") or done.get("tessera_grouped", {}).get("status") == "ok" or
                     done.get("torch", {}).get("status") == "ok"):
            doc[section][name] = done | {"resumed": True}
        elif skipped(what):
            doc[section][name] = {"status": skipped(what)}
        elif left < 40:
            doc[section][name] = {"status": "skipped (time budget)"}
        else:
            doc[section][name] = launch(a, what, min(left, a.run_cap_s))
        print(lines[section](name, doc[section][name]), flush=True)
        write_json(a.out, doc, quiet=True)
    doc["wall_s"] = time.perf_counter() - start
    write_json(a.out, doc)
    failed = [f"{n}: {r['status']}" for s in ("layers", "deltanet", "steps") for n, r in doc[s].items()
              if str(r.get("status", "")).startswith("failed") or
              any(str(v.get("status", "")).startswith("failed") for v in r.values() if isinstance(v, dict))]
    if a.smoke and failed:  # on CPU every run that starts must finish: a failure is a broken benchmark
        sys.exit(f"bench_gpu_moe.py --smoke: {len(failed)} run(s) failed: {failed[0]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=",".join(LAYERS), help="MoE layers, in order")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per MoE layer step (2 sequences)")
    p.add_argument("--deltanet_seqs", default="4096,16384,65536", help="Gated DeltaNet kernel lengths, in order")
    p.add_argument("--chunk_size", type=int, default=64, help="the torch path's chunk of tokens (Gated DeltaNet)")
    p.add_argument("--steps_runs", default="gpt_oss:flex,gpt_oss:materialized,llama4:flex,llama4:materialized,"
                   "qwen3_5:torch,qwen3_5:fla", help="training step runs, model:kernel (kernel: flex or materialized; "
                   "qwen3_5: torch or fla)")
    p.add_argument("--n_layers", default="", help="blocks kept per model, e.g. gpt_oss=4,llama4=1 (default: "
                   "STEP_MODELS's: 6 and 2)")
    gpu_run_options(p, budget_s=420, run_cap_s=120, out=RESULTS / "gpu_moe.json")
    smoke_option(p, layers="qwen3_30b_a3b", tokens=128, deltanet_seqs="128",
                 steps_runs="gpt_oss:flex,llama4:materialized,qwen3_5:torch,qwen3_5:fla", warmup=1, steps=1,
                 budget_s=200, run_cap_s=150)
    a = p.parse_args()
    if a.child:
        return {"layer": child_layer, "deltanet": child_deltanet, "step": child_step}[a.child[0]](a)
    if not torch.cuda.is_available() and not a.smoke:
        print("bench_gpu_moe.py: needs a CUDA GPU and none was found; --smoke runs it on CPU with tiny shapes",
              file=sys.stderr)
        sys.exit(2)
    suite(a)


if __name__ == "__main__":
    main()
