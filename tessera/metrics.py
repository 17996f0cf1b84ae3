"""Throughput, FLOPs, memory, and where they are written: console, metrics.jsonl, TensorBoard, W&B."""

import json
import logging
import os
import resource
import sys
import time

import torch

log = logging.getLogger("tessera")

# Dense bf16 peak FLOP/s per device, from vendors' datasheets (without sparsity).
_GPU_PEAK = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "B100": 1750e12,
             "A100": 312e12, "A800": 312e12, "A10G": 70e12, "L40S": 362e12, "L4": 121e12, "MI300X": 1307e12,
             "MI325X": 1307e12, "MI250X": 383e12}

GIVEN = "metrics.peak_flops"  # the source of a peak the config gives


def measure_gemm_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                      seconds: float = 0.3, rounds: int = 5) -> float:
    """Achieved FLOP/s of a square matmul, the best of `rounds` windows of `seconds / rounds`: the machine's
    practical ceiling for MFU. Other load on the machine only slows a window down, so the fastest is the least
    disturbed (one window's mean, taken while the machine was busy, made the ceiling low and the MFU above 100%)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = 0.0
    for _ in range(rounds):
        iters, start = 0, time.perf_counter()
        while iters == 0 or time.perf_counter() - start < seconds / rounds:
            a @ b
            iters += 1
            sync()
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, given: float = 0.0) -> tuple[float, str]:
    """(FLOP/s, where the number came from): `given` (metrics.peak_flops), a known GPU's datasheet, else a GEMM
    measured now."""
    if given:
        return given, GIVEN
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAK.items():
            if key in name.replace(" ", ""):
                return value, f"datasheet bf16 peak of {name}"
        return measure_gemm_peak(device, torch.bfloat16, 4096), f"measured bf16 GEMM on {name}"
    return measure_gemm_peak(device), f"measured fp32 GEMM on CPU ({torch.get_num_threads()} threads)"


class Peak:
    """The FLOP/s MFU divides by, and where it came from (peak_flops). A run that achieves more proves it low (a
    GEMM measured while the machine was busier, a metrics.peak_flops below the device's): the ceiling rises to what
    was achieved, said once, so the MFU shown never passes 100%."""

    def __init__(self, flops: float, source: str, say: bool = True):
        """`say`: log the rise (rank 0; every rank keeps its own ceiling)."""
        self.flops, self.source, self.say, self.raised = flops, source, say, False

    def mfu(self, achieved: float) -> float:
        """`achieved` FLOP/s as a share of the ceiling."""
        if achieved > self.flops:
            if self.say and not self.raised:
                log.warning(f"mfu: {achieved:.3g} FLOP/s achieved, above the peak of {self.flops:.3g} ({self.source}), "
                            f"which is therefore uncertain: MFU is taken against the highest FLOP/s achieved from "
                            f"here on; {'raise' if self.source == GIVEN else 'set'} metrics.peak_flops to the "
                            f"device's peak for a fixed one")
            self.flops, self.raised = achieved, True
        return achieved / self.flops


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return rss_kib / 2**20


def _eta(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing. Nothing touches the dump folder before
    `open()`, which the trainer calls once the run is known to start (a failed launch writes nothing)."""

    def __init__(self, dump_folder: str, total_steps: int, *, active: bool, tensorboard_dir: str | None = None,
                 wandb: bool = False, config: dict | None = None, labels: dict[str, str] | None = None):
        """`labels`: {metric a family adds: its label on the console line} (Family.metrics)."""
        self.total_steps, self.active, self.labels = total_steps, active, labels or {}
        self.dump_folder, self.tensorboard_dir = dump_folder, tensorboard_dir
        self.use_wandb, self.config = wandb, config
        self.start = time.perf_counter()
        self.jsonl = self.tb = self.wandb = None

    def open(self) -> None:
        if not self.active or self.jsonl is not None:
            return
        self.start = time.perf_counter()
        os.makedirs(self.dump_folder, exist_ok=True)
        self.jsonl = open(os.path.join(self.dump_folder, "metrics.jsonl"), "a")
        if self.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(self.tensorboard_dir)
        if self.use_wandb:
            try:
                import wandb as wb
            except ImportError:
                log.warning("metrics.enable_wandb is set but wandb is not installed (pip install wandb); skipping W&B")
            else:
                self.wandb = wb.init(dir=self.dump_folder, config=self.config)

    def log(self, step: int, metrics: dict[str, float], *, prefix: str = "") -> None:
        if not self.active:
            return
        self.open()
        record = {"step": step, **({f"{prefix}{k}": v for k, v in metrics.items()})}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(f"{prefix}{k}", v, step)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}{k}": v for k, v in metrics.items()}, step=step)
        if prefix:
            parts = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            log.info(f"step {step:>6}  {prefix.rstrip('/')}  {parts}")
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(step, 1) * (self.total_steps - step)
        m = metrics
        own = "".join(f"  {label} {m[key]:.4f}" for key, label in self.labels.items() if key in m)
        log.info(f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  loss {m['loss']:.4f}  "
                 f"grad_norm {m['grad_norm']:.3f}  lr {m['lr']:.2e}  tps {m['tps']:,.0f}  "
                 f"tflops {m['tflops']:.3f}  mfu {m['mfu']:.1%}  mem {m['memory_gib']:.2f}GiB  "
                 f"data {m['data_share']:.1%}{_moe(m)}{own}{_replicas(m)}  eta {_eta(eta)}")

    def image(self, tag: str, picture, step: int) -> None:
        """An HWC uint8 image (a family's samples) to TensorBoard, when it is on."""
        if self.tb is not None:
            self.tb.add_image(tag, picture, step, dataformats="HWC")

    def close(self) -> None:
        for sink in (self.jsonl, self.tb):
            if sink is not None:
                sink.close()
        if self.wandb is not None:
            self.wandb.finish()


class _Stdout(logging.StreamHandler):
    """Writes to sys.stdout as it is at each record: a notebook or a test harness may have swapped it since."""

    stream = property(lambda self: sys.stdout, lambda self, value: None)


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, handlers=[_Stdout()], format="[tessera %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S", force=True)


def _moe(m: dict) -> str:
    """Expert load (max / mean tokens per expert, mean over layers) and the balancing loss, when there are."""
    if "moe_imbalance" not in m:
        return ""
    aux = f"  aux {m['moe_aux_loss']:.4f}" if "moe_aux_loss" in m else ""
    return f"  load {m['moe_imbalance']:.2f} (worst {m['moe_imbalance_worst']:.2f}){aux}"


def _replicas(m: dict) -> str:
    """Fault tolerance: the replica groups in the last step's quorum, and the recoveries so far."""
    if "ft/quorum" not in m:
        return ""
    recovered = f" recovered {m['ft/recoveries']}x in {m['ft/recovery_s']:.1f}s" if m["ft/recoveries"] else ""
    syncs = f" syncs {m['ft/syncs']}" if "ft/failed_syncs" in m else ""  # semi-synchronous groups
    return f"  quorum {m['ft/quorum']}{syncs}{recovered}"
