"""`python -m tessera.plan --model.name llama3 --model.flavor 70B --gpus 64 [--gpu_memory_gib 80] [--seq_len 8192]
[--global_batch_size N] [--top 3] [--json]`: the best layouts for a cluster, as ready-to-run TOML overrides with their
predicted memory and tokens/s.

It searches the degrees (FSDP, or HSDP with one node's shard groups; TP 1-8 within a node; PP; CP keeping 8k+ tokens
per GPU; EP for MoE models), the activation checkpointing mode (none, selective op, full), the micro-batch and, under
PP, the schedule (1F1B, Interleaved1F1B, ZBVZeroBubble), under CP the method that sends fewer bytes (all-gather or
Ulysses, `tessera.estimate.cost.cp_method`) and, for schedules whose backwards are whole, when gradients
are reduce-scattered (`pipeline_parallel_grad_reduce`: step, or microbatch, estimated only when the same layout with
step does not fit: it holds less and costs more collectives). Every candidate must pass the launch checks
(`tessera.preflight.validate`); those whose `floor` (the least a rank holds: parameter, gradient and optimizer shards,
the activations in flight counted low, no trace) exceeds 90% of the GPU memory are dropped; the rest are ranked by the
tokens/s per GPU that `tessera.estimate.cost` predicts (FLOPs over peak x MFU, the pipeline bubble, the communication
a layout cannot hide), then, best first, checked against the GPU memory with `tessera.estimate`: a layout is proposed
only when the estimate's peak fits in 90% of the GPU memory. A layout that does not fit rules out, unestimated, those
of the same degrees that keep more (less recomputation, a larger batch)."""

import copy
import dataclasses
import json
import os
import sys
from types import SimpleNamespace

from tessera import architecture
from tessera.config import ConfigError, JobConfig
from tessera.estimate.cli import CLUSTER, GIB, HEADROOM, Flag, cluster, help_asked, quiet, split
from tessera.estimate.core import estimate, layout_name
from tessera.estimate.cost import Cluster, cp_method, replica_sync, routed_params, step_time
from tessera.parallel.pp import ZERO_BUBBLE, reduces_each_microbatch
from tessera.parallel.pp_layout import MULTI_STAGE
from tessera.preflight import validate
from tessera.run_plan import accumulation_steps
from tessera.schema import parse_args

FLAGS = {
    "gpus": Flag(int, 0, "GPUs of the cluster (nodes x gpus_per_node); required"),
    "gpu_memory_gib": Flag(float, 80.0, "memory of one GPU; a layout must fit in 90% of it"),
    "seq_len": Flag(int, 0, "tokens per sequence; not given: the config's training.seq_len"),
    "global_batch_size": Flag(int, 0, "sequences per optimizer step; not given: local batch x data-parallel ranks "
                                      "(no accumulation)"),
    "top": Flag(int, 3, "layouts to propose"),
    "max_estimates": Flag(int, 40, "memory estimates to run at most before giving the layouts found"),
    "json": Flag(bool, False, "print the proposals as JSON"),
    **CLUSTER,
}
AC = {"none": ("none", "2"), "op": ("selective", "op"), "full": ("full", "2")}  # (mode, selective_ac_option)
AC_LEVEL = {"none": 0, "op": 1, "full": 2}  # higher: less memory
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


@dataclasses.dataclass(kw_only=True)
class Candidate:
    tp: int
    pp: int
    cp: int
    ep: int
    replicate: int
    shard: int
    schedule: str
    ac: str
    local_batch: int
    accumulation: int
    grad_reduce: str = "step"  # parallelism.pipeline_parallel_grad_reduce, under PP
    cp_method: str = "allgather"  # parallelism.context_parallel_method, under CP (tessera.estimate.cost.cp_method)
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    peak: int = 0  # bytes, the exact estimate's
    floor: int = 0  # bytes, the least it can hold (`floor`)

    @property
    def layout(self) -> tuple:
        return self.tp, self.pp, self.cp, self.ep, self.replicate, self.schedule, self.cp_method, self.grad_reduce

    def overrides(self, seq_len: int) -> dict[str, dict[str, object]]:
        """The TOML sections and keys this layout sets."""
        mode, option = AC[self.ac]
        par = {"data_parallel_shard_degree": self.shard, "data_parallel_replicate_degree": self.replicate,
               "tensor_parallel_degree": self.tp, "pipeline_parallel_degree": self.pp,
               "context_parallel_degree": self.cp, "expert_parallel_degree": self.ep}
        if self.cp > 1:
            par.update(context_parallel_method=self.cp_method)
        if self.pp > 1:
            par.update(pipeline_parallel_schedule=self.schedule, pipeline_parallel_microbatch_size=1,
                       pipeline_parallel_grad_reduce=self.grad_reduce)
        dp = self.shard * self.replicate
        return {"parallelism": par,
                "training": {"local_batch_size": self.local_batch, "seq_len": seq_len,
                             "global_batch_size": self.local_batch * dp * self.accumulation},
                "activation_checkpoint": {"mode": mode, "selective_ac_option": option}}

    def flags(self, seq_len: int) -> list[str]:
        return [f for section, keys in self.overrides(seq_len).items() for key, value in keys.items()
                for f in (f"--{section}.{key}", str(value))]


def _divisors(n: int, choices) -> list[int]:
    return [c for c in choices if n % c == 0]


def candidates(cfg: JobConfig, args, gpus: int, gpus_per_node: int, global_batch: int) -> list[Candidate]:
    """Every combination the search takes, before the launch checks."""
    seq, moe = cfg.training.seq_len, getattr(args, "moe", None)
    out = []
    for tp in _divisors(gpus, (1, 2, 4, 8)):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(gpus // tp, (1, 2, 4, 8, 16, 32)):
            for cp in _divisors(gpus // (tp * pp), (1, 2, 4, 8)):
                if seq % (2 * cp) or (cp > 1 and seq // cp < 8192):  # the README: 8k+ tokens per GPU under CP
                    continue
                dp = gpus // (tp * pp * cp)
                node_shard = gpus_per_node // (tp * cp)
                replicates = [1] + ([dp // node_shard] if node_shard and dp % node_shard == 0
                                    and dp // node_shard > 1 else [])
                eps = [1] if moe is None else [e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256)
                                               if moe.n_experts % e == 0 and e % (cp * tp) == 0
                                               and (dp * cp * tp) % e == 0]
                method = cp_method(SimpleNamespace(tp=tp, cp=cp), args, seq / cp)
                for r in replicates:
                    for ep in eps:
                        out += _batches(tp, pp, cp, ep, r, dp // r, global_batch, method)
    return out


def _batches(tp: int, pp: int, cp: int, ep: int, r: int, shard: int, global_batch: int,
             method: str) -> list[Candidate]:
    out = []
    for schedule in SCHEDULES if pp > 1 else ("1F1B",):
        stages = pp * (2 if schedule in MULTI_STAGE else 1)
        batches = (1, 2, 4, 8) if pp == 1 else (stages, 2 * stages)
        for batch in batches:
            per_step = batch * shard * r
            if global_batch and (global_batch % per_step or global_batch < per_step):
                continue
            accumulation = accumulation_steps(global_batch or -1, batch, shard * r)
            reduces = ("step", "microbatch") if pp > 1 and shard * cp > 1 and schedule not in ZERO_BUBBLE \
                else ("step",)
            out += [Candidate(tp=tp, pp=pp, cp=cp, ep=ep, replicate=r, shard=shard, schedule=schedule, ac=ac,
                              local_batch=batch, accumulation=accumulation, grad_reduce=reduce, cp_method=method)
                    for reduce in reduces for ac in AC]
    return out


def configure(base: JobConfig, c: Candidate) -> JobConfig:
    """The base config with the candidate's overrides."""
    cfg = dataclasses.replace(base)
    for section, keys in c.overrides(base.training.seq_len).items():
        part = dataclasses.replace(getattr(cfg, section))
        for key, value in keys.items():
            setattr(part, key, value)
        setattr(cfg, section, part)
    return cfg


def plan(base: JobConfig, gpus: int, memory_gib: float, top: int, max_estimates: int, clu: Cluster,
         global_batch: int = 0) -> tuple[list[Candidate], int]:
    """(the best `top` candidates that fit, best first; the estimates run)."""
    args, counts = sizes(base)
    limit, ranked = HEADROOM * memory_gib * GIB, []
    for c in candidates(base, args, gpus, clu.gpus_per_node, global_batch):
        cfg = configure(base, c)
        try:
            dims = validate(cfg, gpus).dims
        except ConfigError:
            continue
        c.floor = floor(cfg, dims, args, counts)
        if c.floor > limit:
            continue  # cannot fit: not worth an estimate, nor a place in the ranking
        t = step_time(cfg, dims, args, counts, c.accumulation, clu)
        c.tokens_per_s, c.step_s = t.tokens_per_s, t.seconds
        ranked.append(c)
    ranked.sort(key=lambda c: -c.tokens_per_s)
    found, too_big, runs = [], {}, 0
    for c in ranked:
        if len(found) == top or runs >= max_estimates:
            break
        if c.grad_reduce == "microbatch" and any(f.layout[:-1] == c.layout[:-1] and (f.ac, f.local_batch) ==
                                                 (c.ac, c.local_batch) for f in found):
            continue  # its twin reducing once a step fits, and is at least as fast
        if any(AC_LEVEL[c.ac] <= level and c.local_batch >= batch for level, batch in too_big.get(c.layout, ())):
            continue  # keeps at least as much as a candidate of these degrees that did not fit
        runs += 1
        try:
            c.peak = estimate(configure(base, c), gpus, "cuda", clu).peak
        except Exception:  # noqa: BLE001 - a layout whose step fails when traced is no proposal
            c.peak = limit + 1
        if c.peak > limit:
            too_big.setdefault(c.layout, []).append((AC_LEVEL[c.ac], c.local_batch))
        else:
            found.append(c)
    return found, runs


def sizes(cfg: JobConfig) -> tuple[object, object]:
    """(args, counts) of the model the search lays out: its flavor's, with the config's seq_len (every layout
    validates to the same)."""
    fam = architecture.check_model(cfg)
    args = architecture.resolve(architecture.request(fam, cfg), None, None)
    return args, fam.counts(args, cfg.training.seq_len)


def floor(cfg: JobConfig, dims, args, counts) -> int:
    """Bytes a rank of this layout holds at least, from the model's sizes alone (no trace): its fp32 parameter
    shards, their gradients and AdamW's two moments (16 B a parameter of a pipeline stage's share of the layers and
    the larger embedding table; under PP and FSDP also the stage's bf16 parameters, gathered through backward unless
    each micro-batch's gradients are reduce-scattered and its parameters freed after its backward, of its routed
    experts EP's share), and
    what the micro-batches in flight keep (below). Under the traced estimate on every shipped cluster
    (tests/test_estimate.py), it rules a layout out before its speed is ranked, so that a search at scale spends its
    estimates on layouts that can fit."""
    t, p = cfg.training, cfg.parallelism
    table = args.vocab_size * args.dim
    stage = (counts.params - 2 * table) / dims.pp + (table if dims.pp > 1 else 2 * table)
    trained = 4 if cfg.lora.rank else 16  # LoRA: the frozen base's weights alone (its adapters are a rounding)
    states = trained * stage / (dims.tp * dims.dp_shard * dims.cp)
    if dims.pp > 1 and dims.dp_shard * dims.cp > 1 and not reduces_each_microbatch(cfg):  # torch's schedules keep
        # the stage gathered through backward: its routed experts only EP's share of them (FSDP gathers experts
        # within EP groups)
        routed = routed_params(args, counts) / dims.pp
        states += 2 * ((stage - routed) / dims.tp + routed / dims.ep)
    heads, hd = args.n_heads, args.head_dim
    moe = getattr(args, "moe", None)
    sparse = 0.0 if moe is None else moe.n_sparse(args.n_layers) / args.n_layers
    dense_ffn = (1 - sparse) * getattr(args, "ffn_hidden", 0)
    # Elements a token keeps per block (the mean over blocks), eagerly: no AC, the norms' inputs and outputs, q, k, v
    # and attention's output, a SwiGLU's four (or the dispatched rows and each expert's four); selective op AC, the
    # block's input, attention's output and every other matmul's (one of the SwiGLU's at least); full AC, the input.
    block = 4 * args.dim + 2 * heads * hd + 2 * args.n_kv_heads * hd + 4 * dense_ffn \
        + (sparse and sparse * (moe.top_k * (args.dim + 4 * moe.hidden) + 4 * moe.n_shared * moe.hidden)) \
        + counts.extra_act
    ac = cfg.activation_checkpoint
    saved_op = args.dim + heads * hd + dense_ffn + (sparse and sparse * moe.n_shared * moe.hidden)
    kept = {"none": block, "full": args.dim}.get(ac.mode, saved_op if ac.selective_ac_option == "op"
                                                 else args.dim + block / int(ac.selective_ac_option))
    layers = args.n_layers / dims.pp
    if dims.pp == 1:
        rows, in_flight = t.local_batch_size, 1.0
    else:
        n_micro, rows = t.local_batch_size // p.pipeline_parallel_microbatch_size, p.pipeline_parallel_microbatch_size
        v = 2 if p.pipeline_parallel_schedule in MULTI_STAGE else 1
        in_flight = min(n_micro * v, (v + 1) * dims.pp - 1) / v if v > 1 and "Interleaved" in \
            p.pipeline_parallel_schedule else min(n_micro, dims.pp)
    tokens = rows * t.seq_len / (dims.cp * dims.tp)
    act = 2 * tokens * (kept * layers * in_flight + (block if ac.mode == "full" else 0))
    return int(states + act)


def describe(c: Candidate) -> str:
    dims = dataclasses.make_dataclass("D", ["dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"])(
        c.replicate, c.shard, c.cp, c.tp, c.pp, c.ep)
    ac = {"none": "no AC", "op": "selective op AC", "full": "full AC"}[c.ac]
    pipe = f", {c.schedule}" if c.pp > 1 else ""
    pipe += ", gradients reduce-scattered each micro-batch" if c.grad_reduce == "microbatch" else ""
    acc = f" x {c.accumulation} accumulation steps" if c.accumulation > 1 else ""
    return f"{layout_name(dims, c.cp_method)}{pipe}, {ac}, local batch {c.local_batch}{acc}"


def toml(c: Candidate, seq_len: int) -> str:
    lines = []
    for section, keys in c.overrides(seq_len).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    return "\n".join(lines)


def report(found: list[Candidate], runs: int, cfg: JobConfig, gpus: int, memory_gib: float, clu: Cluster) -> str:
    head = (f"{cfg.model.name} {cfg.model.flavor} on {gpus} GPUs of {memory_gib:g} GiB ({clu.gpus_per_node} per node), "
            f"seq {cfg.training.seq_len}: {len(found)} layout(s) that fit, best first ({runs} memory estimates)")
    lines, groups, params = [head], cfg.fault_tolerance, sizes(cfg)[1].params
    for i, c in enumerate(found, 1):
        lines += ["", f"{i}. {describe(c)}: peak {c.peak / GIB:.1f} GiB per GPU, {c.tokens_per_s:,.0f} tokens/s per "
                      f"GPU (step {c.step_s:.3g} s)", toml(c, cfg.training.seq_len),
                  *(f"# {line}" for line in [replica_sync(groups, params, gpus // c.replicate, c.step_s, clu)] if line),
                  f"# NGPU=... ./run_train.sh --job.config_file <file> {' '.join(c.flags(cfg.training.seq_len))}"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if help_asked(argv, __doc__, FLAGS):
        return 0
    try:
        values, rest = split(argv, FLAGS)
        if not values["gpus"]:
            raise ConfigError("--gpus: required; give the cluster's GPU count (nodes x gpus_per_node)")
        cfg = parse_args(rest)
        architecture.check_model(cfg)
        if values["seq_len"]:
            cfg.training.seq_len = values["seq_len"]
        if cfg.model.flavor == "":
            raise ConfigError("--model.flavor: required; the size to plan for (e.g. 8B)")
        assets = cfg.model.hf_assets_path  # a plan needs no tokenizer: the flavor says the vocabulary
        if assets and not os.path.isfile(os.path.join(assets, "tokenizer.json")):
            print(f"tessera: no tokenizer.json in {assets}: the flavor's vocabulary is taken", file=sys.stderr)
            cfg.model.hf_assets_path = ""
        clu = cluster(values)
        planned = copy.deepcopy(cfg)
        planned.fault_tolerance.enable = False  # one replica group is planned (its lighthouse is no concern here)
        with quiet():
            found, runs = plan(planned, values["gpus"], values["gpu_memory_gib"], values["top"],
                               values["max_estimates"], clu, values["global_batch_size"])
    except ConfigError as err:
        print(f"tessera: {err}", file=sys.stderr)
        return 2
    if values["json"]:
        print(json.dumps([{**dataclasses.asdict(c), "overrides": c.overrides(cfg.training.seq_len)} for c in found]))
    else:
        print(report(found, runs, cfg, values["gpus"], values["gpu_memory_gib"], clu))
    if not found:
        print(f"tessera: no layout searched fits {values['gpu_memory_gib']:g} GiB per GPU (within "
              f"{values['max_estimates']} estimates); more GPUs, a shorter seq_len, or --max_estimates",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
