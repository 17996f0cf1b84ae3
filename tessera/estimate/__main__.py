"""`python -m tessera.estimate --job.config_file F [--world-size N] [--device cuda] [--json] [--section.key V ...]`:
the memory per rank kind (parameters, gradients, optimizer state, activations per micro-batch and how many are in
flight, communication buffers, the peak) and the time of a step of that run, before any GPU is allocated. It
builds the configured model and layout exactly as training would (meta device, a fake process group of N ranks,
fake tensors), so it runs on a laptop. Exit status 0; a config that would not launch: one line naming it, 2."""

import json
import sys

from tessera.config import ConfigError
from tessera.estimate.cli import CLUSTER, GIB, HEADROOM, Flag, cluster, help_asked, quiet, split
from tessera.estimate.core import Estimate, Sampling, estimate
from tessera.schema import parse_args

FLAGS = {
    "world_size": Flag(int, 0, "ranks (GPUs) of the run; not given: the product of the config's degrees (needs "
                                "data_parallel_shard_degree set)"),
    "device": Flag(str, "cuda", "the device the run is for: cuda (bf16 compute under 'auto', FlexAttention's "
                                "memory for masked attention) or cpu (as tessera.train runs on a CPU)",
                   choices=("cuda", "cpu")),
    "gpu_memory_gib": Flag(float, 80.0, "a GPU's memory, for the line saying whether the peak fits"),
    "exact": Flag(bool, False, "trace every block, not one or two of each kind scaled to the model's (the same "
                               "bytes on every shipped config, slower)"),
    "json": Flag(bool, False, "print the estimate as one JSON object (bytes) instead of the table"),
    **CLUSTER,
}


def world_size(cfg, asked: int) -> int:
    if asked:
        return asked
    p = cfg.parallelism
    if p.data_parallel_shard_degree == -1:
        raise ConfigError("--world-size: the config leaves data_parallel_shard_degree = -1 (all ranks left), so the "
                          "world size is unknown; give --world-size N")
    return (p.data_parallel_shard_degree * p.data_parallel_replicate_degree * p.tensor_parallel_degree
            * p.pipeline_parallel_degree * p.context_parallel_degree)


def table(e: Estimate, gpu_memory_gib: float) -> str:
    head = (f"{e.model} {e.flavor or '(architecture from checkpoint)'}: {e.params / 1e9:.2f}B parameters, {e.layout} "
            f"on {e.world_size} rank(s), for {e.device}; seq {e.seq_len} x local batch {e.local_batch_size}, "
            f"{e.grad_accum} accumulation step(s)")
    cols = ("rank kind", "ranks", "params", "grads", "optimizer", "act/mb", "in flight", "comm", "peak GiB")
    rows = [cols] + [(k.label, str(k.count), *(f"{v / GIB:.2f}" for v in (k.params, k.grads, k.optimizer, k.act)),
                      str(k.in_flight), f"{k.comm / GIB:.2f}", f"{k.peak / GIB:.2f}") for k in e.kinds]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head, ""] + ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                    for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    fits = e.peak <= HEADROOM * gpu_memory_gib * GIB
    t, c = e.time, e.cluster
    lines += ["", f"peak {e.peak / GIB:.2f} GiB per GPU: {'fits' if fits else 'does NOT fit'} {gpu_memory_gib:g} GiB "
              f"(planning on {HEADROOM:.0%} of it)",
              f"FLOPs per step {t.flops:.3g} ({t.flops / e.world_size:.3g} per GPU); at {c.peak_tflops:g} TFLOP/s x "
              f"MFU {c.mfu:.0%}: step {t.seconds:.3g} s (compute {t.compute:.3g}, pipeline bubble {t.bubble:.3g}, "
              f"exposed communication {t.comm:.3g}), {t.tokens_per_s:,.0f} tokens/s per GPU"]
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)


def traced_failure(err: BaseException) -> str:
    root = err.__cause__ or err
    what = (str(root).strip().splitlines() or [""])[0]
    return (f"the configured step fails when traced ({type(root).__name__}: {what}); a run of this config would most "
            f"likely fail the same way")


def main(argv: list[str]) -> int:
    if help_asked(argv, __doc__, FLAGS):
        return 0
    try:
        values, rest = split(argv, FLAGS)
        cfg = parse_args(rest)
        n = world_size(cfg, values["world_size"])
        with quiet():
            e = estimate(cfg, n, values["device"], cluster(values), sampling=Sampling(exact=values["exact"]))
    except ConfigError as err:
        print(f"tessera: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the traced step itself failed: said in one line, status 1
        print(f"tessera: {traced_failure(err)}", file=sys.stderr)
        return 1
    print(json.dumps(e.to_json()) if values["json"] else table(e, values["gpu_memory_gib"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
