"""What the benchmarks share: trainer flags, a one-process trainer, alternating timed rounds, JSON out."""

import argparse
import atexit
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_DUMPS: list[tempfile.TemporaryDirectory] = []
atexit.register(lambda: [d.cleanup() for d in _DUMPS])
# Compilation starts cold in each benchmark process, as on a fresh machine: no inductor or Triton cache carried
# over from earlier runs or other configurations. Set TORCHINDUCTOR_CACHE_DIR to reuse one instead. (Here, before
# any import of tessera: importing it fills in the default.)
_COLD_CACHE = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
if _COLD_CACHE:
    _DUMPS.append(tempfile.TemporaryDirectory(prefix="tessera-bench-cache-", ignore_cleanup_errors=True))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _DUMPS[-1].name
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_DUMPS[-1].name, "triton")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from tessera.distributed import init_world  # noqa: E402
from tessera.preflight import validate  # noqa: E402
from tessera.schema import parse_args  # noqa: E402
from tessera.trainer import Trainer, build_trainer  # noqa: E402

COMPILE = ["--compile.enable"]
AC = {"none": [], "full": ["--activation_checkpoint.mode", "full"],
      "selective_op": ["--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.selective_ac_option", "op"]}
FLOAT8 = ["--model.converters", "quantize.linear.float8"]


def smoke_option(p: argparse.ArgumentParser, **tiny) -> None:
    """Adds --smoke: the defaults become `tiny` (small sizes, a few steps) and the JSON goes to a temporary file;
    options given explicitly still win. It checks that the script runs end to end (tests/test_benchmarks.py runs
    every script so); its numbers mean nothing."""
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and a few steps, JSON to a temporary file: checks that the script runs")
    if "--smoke" in sys.argv[1:]:
        out = Path(tempfile.gettempdir(), "tessera-smoke", Path(sys.argv[0]).stem + ".json")
        p.set_defaults(**{"out": str(out), **tiny})


def gpu_run_options(p: argparse.ArgumentParser, budget_s: float, run_cap_s: float, out: Path) -> None:
    """The options of a one-GPU suite of timed runs, each a process (bench_gpu.py, bench_gpu_moe.py)."""
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens in the first)")
    p.add_argument("--steps", type=int, default=6, help="timed steps; tokens/s is from the median one")
    p.add_argument("--budget_s", type=float, default=budget_s, help="stop starting runs after this many seconds")
    p.add_argument("--run_cap_s", type=float, default=run_cap_s, help="time limit of one run")
    p.add_argument("--resume", action="store_true", help="keep the finished runs of --out, run the others")
    p.add_argument("--out", default=str(out))
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a benchmark subprocess: finds tessera (and what PYTHONPATH held: the GPU suites' carried
    wheels), and gets its own cold compile cache (unless set)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, **extra}
    if _COLD_CACHE:
        env.pop("TORCHINDUCTOR_CACHE_DIR")
        env.pop("TRITON_CACHE_DIR")
    return env


def tessera_argv(flavor: str, seq_len: int, batch: int, steps: int, lr: float = 8e-4, log_freq: int = 10**9,
                 dump: str | None = None) -> list[str]:
    """Trainer flags for a benchmark: constant lr (no warmup, no decay), like a plain loop; bf16 on CUDA."""
    argv = ["--model.flavor", flavor, "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
            "--training.steps", str(steps), "--optimizer.lr", str(lr), "--lr_scheduler.warmup_steps", "0",
            "--lr_scheduler.decay_ratio", "0", "--metrics.log_freq", str(log_freq)]
    argv += ["--job.dump_folder", dump] if dump else []
    # On one GPU, "auto" does not enable autocast; ask for bf16 explicitly so every side computes in bf16.
    return argv + (["--training.mixed_precision_param", "bfloat16"] if torch.cuda.is_available() else [])


def run_worker(script: str, ranks: int, args: list[str], label: str) -> dict:
    """`script --worker OUT.json *args` under torchrun on `ranks` ranks, one thread each; the JSON it wrote."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script,
               "--worker", str(out), *args]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{label} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def make_trainer(argv: list[str]) -> Trainer:
    """A one-process trainer from flags, writing to a temporary folder; keeps this process's thread count."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # one process, whatever launched us
        os.environ.pop(key, None)
    if "--job.dump_folder" not in argv:
        _DUMPS.append(tempfile.TemporaryDirectory(prefix="tessera-bench-", ignore_cleanup_errors=True))
        argv = [*argv, "--job.dump_folder", _DUMPS[-1].name]
    cfg = parse_args(argv)
    threads = torch.get_num_threads()
    run = validate(cfg, 1)
    world = init_world(run.dims)
    torch.set_num_threads(threads)  # init_world picks its own count on CPU
    return build_trainer(run, world)


def sync_for(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def gemm_setup(device: torch.device) -> tuple[torch.dtype, int]:
    """(dtype, n) of the square GEMM whose measured FLOP/s is the MFU ceiling: fp32 on CPU, bf16 on GPU."""
    return (torch.bfloat16, 8192) if device.type == "cuda" else (torch.float32, 1024)


def timed(step: Callable[[int], torch.Tensor], warmup: int, steps: int, sync) -> dict:
    """`warmup` untimed steps, then `steps` timed ones: steps/s, loss of the last step, seconds of the first."""
    sync()
    start = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        loss = step(i)
        if i == 0:
            sync()
            first_s = time.perf_counter() - start
    sync()
    return {"steps_per_s": steps / (time.perf_counter() - start), "loss": float(loss), "first_step_s": first_s}


def alternate(runs: dict[str, Callable[[int], torch.Tensor]], rounds: int, warmup: int, steps: int, sync,
              tokens_per_step: int, before_each_round: Callable[[], None] = lambda: None) -> dict:
    """Runs take turns step by step (a, b, a, b, ...), so that load swings, which last seconds here, hit each alike.
    Each round: `warmup` untimed steps, then `steps` timed ones, per run. Per run: every timed step's seconds,
    tokens/s from the median step, the loss after round 1 and the very first step's seconds (compilation included).
    Compare runs with `paired_ratio`."""
    out = {name: {"step_s": []} for name in runs}
    for r in range(rounds):
        before_each_round()
        for i in range(warmup + steps):
            for name, step in runs.items():
                sync()
                start = time.perf_counter()
                loss = step(i)
                sync()
                seconds = time.perf_counter() - start
                if i >= warmup:
                    out[name]["step_s"].append(seconds)
                if r == 0 and i == 0:
                    out[name]["first_step_s"] = seconds
                if r == 0 and i == warmup + steps - 1:
                    out[name]["loss_after_round_1"] = float(loss)
        print(f"round {r + 1}/{rounds}  " + "  ".join(
            f"{name} {tokens_per_step / statistics.median(res['step_s'][-steps:]):,.0f}" for name, res in out.items())
            + "  tokens/s", flush=True)
    for res in out.values():
        res["tokens_per_s"] = tokens_per_step / statistics.median(res["step_s"])
    return out


def paired_ratio(out: dict, faster: str, slower: str) -> float:
    """How many times faster `faster` ran than `slower`: the median over their back-to-back timed steps."""
    return statistics.median(s / f for f, s in zip(out[faster]["step_s"], out[slower]["step_s"], strict=True))


def write_json(path: str | Path, result: dict, quiet: bool = False) -> None:
    """`result` as JSON, marked `"smoke": true` under --smoke (summary.py then judges nothing)."""
    result = {**result, "smoke": "--smoke" in sys.argv[1:]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    if not quiet:
        print(f"  -> {path}")


def layer_device():
    """(device, dtype) of the one-layer benchmarks: CUDA in bf16 when there is a GPU, else CPU in fp32."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32
