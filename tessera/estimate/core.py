"""Memory and time of a configured run, per rank kind, before any GPU is allocated (see tessera/estimate/__main__.py).

Each rank kind (every rank alike, or each pipeline rank) is built as the trainer builds it over a fake process
group and traced on fake tensors (tessera/estimate/trace.py): parameters, gradients and what one step's
micro-batches allocate are counted storage by storage; AdamW's state is two moments per parameter shard. Under
pipelining, each distinct stage is traced with two micro-batches in flight (the step's first backward, without
gradients, then one with them), and the schedule's own order of forwards and backwards
(tessera/estimate/pipeline.py) says how many it holds at once, with its receive buffers and the last stage's outputs
kept to the end of the step."""

import copy
import dataclasses
import functools
import os

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import PipelineStage

from tessera import lora, models
from tessera.config import ConfigError, JobConfig
from tessera.data import build_tokenizer
from tessera.estimate import pipeline, scans, trace
from tessera.estimate.cost import Cluster, StepTime, replica_sync, step_time
from tessera.parallel import pp, pp_layout
from tessera.preflight import validate
from tessera.run_plan import Batch


@dataclasses.dataclass(kw_only=True)
class RankKind:
    label: str
    count: int  # ranks of this kind
    params: int  # bytes: this rank's parameter shards and buffers
    grads: int  # what backward leaves (gradients; under PP + FSDP also the parameters kept gathered)
    optimizer: int
    act: int  # activations one micro-batch keeps from its forward to its backward (all its stages)
    in_flight: int  # micro-batches (stage forwards) held at once
    comm: int  # communication buffers: collective outputs alive at once, and pipeline receive buffers
    peak: int


@dataclasses.dataclass(kw_only=True)
class Estimate:
    model: str
    flavor: str
    world_size: int
    layout: str
    device: str
    seq_len: int
    local_batch_size: int
    grad_accum: int
    params: int  # the whole model's
    kinds: list[RankKind]
    time: StepTime
    cluster: Cluster
    notes: list[str]

    @property
    def peak(self) -> int:
        return max(k.peak for k in self.kinds)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["peak"] = self.peak
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How many of a module's blocks are traced (see `sampled`)."""
    exact: bool = False  # every block
    above: int = 8  # a module of more blocks is traced with one or two blocks of each kind, scaled
    only_if_cheaper: bool = True  # ...when those traces hold fewer blocks than the module (tests compare the two on
    # small models)


def layout_name(dims, cp_method: str = "allgather") -> str:
    parts = [(f"HSDP {dims.dp_replicate}x{dims.dp_shard}" if dims.dp_replicate > 1 and dims.dp_shard > 1
              else f"DDP {dims.dp_replicate}" if dims.dp_replicate > 1 else f"FSDP {dims.dp_shard}"
              if dims.dp_shard > 1 else "")]
    cp = "Ulysses CP" if cp_method == "ulysses" else "CP"
    parts += [f"{n} {d}" for n, d in (("TP", dims.tp), ("PP", dims.pp), (cp, dims.cp), ("EP", dims.ep)) if d > 1]
    return " x ".join(p for p in parts if p) or "1 rank"


def prepare(cfg: JobConfig, device: str) -> tuple[JobConfig, list[str]]:
    """The config as it runs on `device` (cuda or cpu), and notes for the reader."""
    cfg, notes = copy.deepcopy(cfg), []
    cfg.fault_tolerance.enable = False  # one replica group is estimated (its lighthouse is no concern here)
    t = cfg.training
    # The data does not change what a step holds (tokens are tokens): the built-in corpus stands in, so a config
    # whose data is on the cluster estimates anywhere.
    t.dataset, t.dataset_path = "stdlib", ""
    if hasattr(t, "dataset_mix"):
        t.dataset_mix = ""
    if t.mixed_precision_param == "auto":
        t.mixed_precision_param = "bfloat16" if device == "cuda" else "float32"
    if cfg.compile.enable:
        cfg.compile.enable = False
        notes.append("compile: traced eagerly; compiled blocks fuse element-wise ops and keep less, so the "
                     "activations are an upper bound")
    if cfg.model.hf_assets_path and not os.path.isfile(os.path.join(cfg.model.hf_assets_path, "tokenizer.json")):
        notes.append(f"no tokenizer.json in {cfg.model.hf_assets_path}: the flavor's vocabulary is taken")
        cfg.model.hf_assets_path = ""
    if t.enable_cpu_offload:
        notes.append("training.enable_cpu_offload: parameter shards, gradients and optimizer state are in host "
                     "memory, not in the peak")
    return cfg, notes


def estimate(cfg: JobConfig, world_size: int, device: str = "cuda", cluster: Cluster | None = None,
             sampling: Sampling = Sampling()) -> Estimate:
    """Raises ConfigError for a config that would not launch (as `python -m tessera.config` would). `sampling`:
    which blocks are traced (Sampling(exact=True): every block, not one or two of each kind)."""
    groups = cfg.fault_tolerance
    cfg, notes = prepare(cfg, device)
    run = validate(cfg, world_size)
    dims, fam = run.dims, run.family
    spec = fam.spec()
    if spec.training is not None:
        raise ConfigError(f"model.name: {cfg.model.name} brings its own batches; tessera.estimate traces the token "
                          f"models ({', '.join(n for n in models.FAMILIES if n != cfg.model.name)})")
    args, t, grad_accum = run.args, cfg.training, run.batch.accumulation  # the architecture validate resolved
    bos = build_tokenizer(cfg.model.hf_assets_path).bos_id if run.cfg.model.attn_mask_type == "block_causal" \
        else None
    build = functools.partial(_build, spec, args, device == "cuda")
    kinds = _whole(cfg, dims, args, spec, run.batch, bos, sampling, build) if dims.pp == 1 else \
        _pipelined(cfg, dims, args, spec, run.batch, sampling, build)
    if t.enable_cpu_offload:
        for k in kinds:
            k.peak -= k.params + k.optimizer
    counts = lora.trained_counts(fam.counts(args, t.seq_len), cfg.lora)
    cluster = cluster or Cluster()
    time = step_time(cfg, dims, args, counts, grad_accum, cluster)
    name = layout_name(dims, cfg.parallelism.context_parallel_method)
    if line := replica_sync(groups, counts.params, dims.world_size // dims.dp_replicate, time.seconds, cluster):
        notes.append(line)
    return Estimate(model=cfg.model.name, flavor=cfg.model.flavor, world_size=world_size, layout=name, device=device,
                    seq_len=t.seq_len, local_batch_size=t.local_batch_size, grad_accum=grad_accum,
                    params=counts.params, kinds=kinds, time=time, cluster=cluster, notes=notes)


def _build(spec, args, gpu: bool) -> torch.nn.Module:
    """The model on the meta device, with the kernels it is traced with: DeltaNet's scan allocating its bytes at
    once (tessera.estimate.scans), and for a GPU attention holding what FlexAttention holds (trace.gpu_attention)."""
    with torch.device("meta"):
        model = scans.scans_at_once(spec.model(args))
    return trace.gpu_attention(model) if gpu else model


def _block_kind(block: torch.nn.Module) -> int:
    """Blocks of one kind (parameter shapes, types, settings such as a window) trace alike."""
    kind = []
    for name, m in block.named_modules():
        settings = sorted((k, v) for k, v in vars(m).items()
                          if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None))))
        kind.append((name, type(m).__name__, tuple(settings),
                     tuple((n, tuple(p.shape)) for n, p in m.named_parameters(recurse=False))))
    return hash(tuple(kind))


def _kinds(module: torch.nn.Module, stacks: tuple[str, ...]) -> list[int]:
    """The kind of each block of `module`'s block stacks, in forward order."""
    return [_block_kind(block) for stack in stacks for block in getattr(module, stack).values()]


def sampled(kinds: list[int], run, sampling: Sampling) -> trace.StageTrace:
    """`run(positions)` traces the module holding only the blocks at those positions. A module of more than
    `sampling.above` blocks is traced with one block of each kind (two when there is one kind: a first and a last), then
    with one more block of each kind in turn, and its bytes grow linearly from there with each kind's count: each
    block adds its parameters, gradients and saved activations, and the largest moment of each phase of a step or a
    backward (tessera.estimate.trace._phase_marks) moves with them. Collective buffers and pipeline boundaries are
    those of one block. On every shipped config this gave the whole trace's bytes to 0.4% (checked by hand);
    tests/test_estimate.py compares the two on debug models with blocks of several kinds."""
    if sampling.exact or len(kinds) <= sampling.above:
        return run(list(range(len(kinds))))
    by_kind = {}
    for pos, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(pos)
    used = {kind: 2 if len(by_kind) == 1 else 1 for kind in by_kind}  # a first and a last block, not one
    base_ids = sorted(pos for kind, ids in by_kind.items() for pos in ids[:used[kind]])
    runs = 1 + sum(len(ids) > used[kind] for kind, ids in by_kind.items())
    if sampling.only_if_cheaper and runs * len(base_ids) + runs - 1 >= len(kinds):  # as many blocks as it holds
        return run(list(range(len(kinds))))
    base = run(base_ids)
    total = dataclasses.replace(base)
    for kind, ids in by_kind.items():
        if len(ids) <= used[kind]:
            continue
        more, n = run(sorted([*base_ids, ids[used[kind]]])), len(ids) - used[kind]
        for f in _LINEAR:
            setattr(total, f, getattr(total, f) + n * (getattr(more, f) - getattr(base, f)))
        for f in ("phases", "first_phases", "transient_phases"):
            setattr(total, f, tuple(t + n * (m - b) for t, m, b in zip(getattr(total, f), getattr(more, f),
                                                                       getattr(base, f), strict=True)))
        total.comm = max(total.comm, more.comm)
    # Each phase's largest moment grows linearly; a step's (or a backward's) is the largest of them, the middle
    # blocks' excepted (at its ends, it is its neighbours').
    if total.phases:
        total.peak = max(p for i, p in enumerate(total.phases) if i % 4 != trace.MIDDLE)
    if total.first_phases:
        total.first = max(total.first_phases[0], total.first_phases[2])
        total.transient = max(total.transient_phases[0], total.transient_phases[2])
    return total


_LINEAR = ("params", "optimizer", "grads", "act", "end")


def _whole(cfg, dims, args, spec, batch: Batch, bos: int | None, sampling: Sampling, build) -> list[RankKind]:
    model = build()

    def run(positions: list[int]) -> trace.StageTrace:
        with trace.fake_world(dims, 0) as world:
            part = pp.cut(model, positions, blocks=spec.blocks)
            part = spec.parallelize(part, world, cfg)
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            trace.materialize(part, world, fake)
            return trace.trace_model(cfg, world, part, spec, args, batch, bos, fake)

    tr = sampled(_kinds(model, spec.blocks), run, sampling)
    return [RankKind(label="every rank", count=dims.world_size, params=tr.params, grads=tr.grads,
                     optimizer=tr.optimizer, act=tr.act, in_flight=1, comm=tr.comm, peak=tr.optimizer + tr.peak)]


def _pipelined(cfg, dims, args, spec, batch: Batch, sampling: Sampling, build) -> list[RankKind]:
    p = cfg.parallelism
    model = build()
    kinds = _kinds(model, spec.blocks)
    n_stages = pp_layout.num_stages(len(kinds), dims.pp, p.pipeline_parallel_schedule,
                                    p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_split_points,
                                    p.pipeline_parallel_first_stage_less_layers,
                                    p.pipeline_parallel_last_stage_less_layers)
    layers = pp_layout.stage_layers(len(kinds), n_stages, p.pipeline_parallel_split_points,
                                    p.pipeline_parallel_first_stage_less_layers,
                                    p.pipeline_parallel_last_stage_less_layers)
    n_micro = cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size
    per_pp = dims.world_size // dims.pp
    traced: dict = {}
    orders = None
    out = []
    for r in reversed(range(dims.pp)):  # the last stage first: its logits make it the largest, or the one that fails
        ids = pp_layout.rank_stages(r, dims.pp, n_stages, p.pipeline_parallel_schedule)
        keys = [(i == 0, i == n_stages - 1, tuple(sorted(kinds[n] for n in layers[i]))) for i in ids]
        if orders is None or any(k not in traced for k in keys):
            orders = _trace_rank(cfg, dims, args, spec, batch, r * per_pp, keys, traced, n_micro, orders,
                                 sampling, build)
        stages = [traced[k] for k in keys]
        order = orders.get(r) or pipeline.single_order(p.pipeline_parallel_schedule, ids[0], n_stages, n_micro)
        costs = {i: pipeline.StageCost(grads=s.grads, act=s.act, input_grad=0 if k[0] else s.io,
                                       first=s.first, transient=s.transient, end=s.end)
                 for i, s, k in zip(ids, stages, keys, strict=True)}
        extra, in_flight = pipeline.held(order, costs)
        buffers = sum(n_micro * s.io * ((not k[0]) + (not k[1])) for s, k in zip(stages, keys, strict=True))
        params, grads = sum(s.params for s in stages), sum(s.grads for s in stages)
        optimizer = sum(s.optimizer for s in stages)
        out.append(RankKind(label=f"pp rank {r} (stage{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))})",
                            count=per_pp, params=params, grads=grads, optimizer=optimizer,
                            act=sum(s.act for s in stages), in_flight=in_flight,
                            comm=max(s.comm for s in stages) + buffers, peak=params + optimizer + buffers + extra))
    return out[::-1]


def _trace_rank(cfg, dims, args, spec, batch: Batch, rank: int, keys: list, traced: dict, n_micro: int,
                orders: dict | None, sampling: Sampling, build) -> dict:
    """Trace the stages of `rank` not traced yet (into `traced`, by key); returns every rank's schedule order."""
    model = build()
    with trace.fake_world(dims, rank) as world:
        pp_mesh = world.mesh["pp"]
        ids, parts, n_stages = pp.split(model, pp_mesh, cfg, spec.first_stage, spec.last_stage, spec.blocks)
        if orders is None:  # every rank's order, from torch's schedule over this rank's stages
            stages = [PipelineStage(part, i, n_stages, world.device, group=pp_mesh.get_group())
                      for part, i in zip(parts, ids, strict=True)]
            orders = pipeline.orders(stages, cfg, n_micro) or {}
        for part, i, key in zip(parts, ids, keys, strict=True):
            if key in traced:
                continue

            def run(positions: list[int], part=part, i=i) -> trace.StageTrace:
                fake = FakeTensorMode(allow_non_fake_inputs=True)
                piece = pp.cut(part, positions, blocks=spec.blocks)
                spec.parallelize(piece, world, cfg)
                trace.materialize(piece, world, fake)
                stage = pp.make_stage(piece, i, n_stages, world.device, pp_mesh, cfg)
                return trace.trace_stage(cfg, world, stage, spec, args, batch, fake)

            traced[key] = sampled(_kinds(part, spec.blocks), run, sampling)
    return orders
