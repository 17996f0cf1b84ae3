"""A step's time on a cluster, from its FLOPs and its communication. Simple on purpose, every term below:

- compute: the step's training FLOPs per device (6 N + attention, the family's count, times the tokens of the
  step) plus what activation checkpointing recomputes (full: the blocks' forward again, +1/3; selective op:
  about half of it, +1/6; selective N: +1/(3N)), over peak x MFU (the share of peak the matmuls reach).
- pipeline bubble: compute x (PP - 1) / (micro-batches x stages per rank); zero-bubble schedules (and V-shaped
  ones) fill two thirds of it.
- communication, per device, at the bandwidth of the link its group spans (one node: `intra_gbps`, NVLink;
  more: `inter_gbps`, the network), and how much of it compute hides:
  FSDP all-gathers the bf16 parameters (again in backward, when resharded) and reduce-scatters the fp32
  gradients, every micro-batch: (group - 1) / group of them; prefetched, it hides behind compute, so only what
  exceeds the compute shows. HSDP adds an all-reduce of the gradient shards across replicas (exposed).
  TP (sequence parallel): per layer and micro-batch, 4 all-gathers / reduce-scatters of the residual stream
  forward and 4 backward, (TP - 1) / TP of it each; exposed (async TP hides half).
  CP: per layer, an all-gather of keys and values forward and a reduce-scatter of their gradients backward;
  exposed. EP: per MoE layer, tokens x top-k rows to their experts and back, forward and backward; exposed.
  PP: each micro-batch's boundary activations and their gradients between stages; exposed.
"""

import dataclasses


@dataclasses.dataclass
class Cluster:
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # dense bf16 of an H100/H200
    mfu: float = 0.4
    intra_gbps: float = 450.0  # GB/s per GPU inside a node (NVLink)
    inter_gbps: float = 50.0  # GB/s per GPU between nodes (400 Gb/s)


@dataclasses.dataclass
class StepTime:
    compute: float
    bubble: float
    comm: float  # exposed
    seconds: float
    tokens_per_s: float  # per device
    flops: float  # per step, all devices (model FLOPs, no recompute)


def recompute_share(mode: str, option: str) -> float:
    if mode == "full":
        return 1 / 3
    if mode == "selective":
        return 1 / 6 if option == "op" else 1 / (3 * int(option))
    return 0.0


def bubble_share(schedule: str, pp: int, n_micro: int, stages_per_rank: int) -> float:
    if pp == 1:
        return 0.0
    share = (pp - 1) / (n_micro * stages_per_rank)
    return share / 3 if "ZeroBubble" in schedule or schedule == "DualPipeV" else share


def _bw(span: int, cluster: Cluster) -> float:
    """Bytes/s of a group of `span` consecutive ranks (the mesh's inner axes are the node's)."""
    return (cluster.intra_gbps if span <= cluster.gpus_per_node else cluster.inter_gbps) * 1e9


def step_time(cfg, dims, args, flops_per_token: float, param_bytes: int, grad_accum: int,
              cluster: Cluster) -> StepTime:
    """`param_bytes`: this rank's parameter shards (fp32), what FSDP gathers and reduces."""
    t, p = cfg.training, cfg.parallelism
    n_micro = t.local_batch_size // p.pipeline_parallel_microbatch_size if dims.pp > 1 else 1
    per_rank_stages = 2 if p.pipeline_parallel_schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                                           "ZBVZeroBubble", "DualPipeV") else 1
    tokens = t.local_batch_size * t.seq_len * dims.dp * grad_accum
    flops = flops_per_token * tokens
    ac = cfg.activation_checkpoint
    compute = flops / dims.world_size * (1 + recompute_share(ac.mode, ac.selective_ac_option)) \
        / (cluster.peak_tflops * 1e12 * cluster.mfu)
    bubble = compute * bubble_share(p.pipeline_parallel_schedule, dims.pp, n_micro, per_rank_stages)
    exposed = _exposed_comm(cfg, dims, args, param_bytes, grad_accum, compute, cluster)
    seconds = compute + bubble + exposed
    return StepTime(compute, bubble, exposed, seconds, tokens / dims.world_size / seconds, flops)


def _exposed_comm(cfg, dims, args, param_bytes: int, grad_accum: int, compute: float, cluster: Cluster) -> float:
    t, p = cfg.training, cfg.parallelism
    act = 2  # bytes per activation element (bf16)
    layers = args.n_layers / dims.pp
    rows = t.local_batch_size * grad_accum * t.seq_len / dims.cp  # tokens a rank's CP/TP group runs per step
    fsdp = dims.dp_shard * dims.cp
    passes = grad_accum * (1 if p.fsdp_reshard_after_forward == "never" else 2)  # gathers per step: fwd (+ bwd)
    # Gathered in bf16 (half the fp32 shard's bytes from each of the others), reduced in fp32.
    fsdp_s = (fsdp - 1) * param_bytes * (passes / 2 + grad_accum) / _bw(fsdp * dims.tp, cluster) if fsdp > 1 else 0.0
    hsdp_s = 2 * (dims.dp_replicate - 1) / dims.dp_replicate * param_bytes / _bw(dims.world_size // dims.pp, cluster)
    tp_s = 8 * (dims.tp - 1) / dims.tp * rows * args.dim * act * layers / _bw(dims.tp, cluster)
    kv = getattr(args, "n_kv_heads", args.n_heads) * getattr(args, "head_dim", args.dim // args.n_heads) / dims.tp
    cp_s = 2 * (dims.cp - 1) * rows * 2 * kv * act * layers / _bw(dims.cp * dims.tp, cluster)
    moe = getattr(args, "moe", None)
    ep_s = 0.0
    if moe is not None and dims.ep > 1:
        moe_layers = moe.n_sparse(args.n_layers) / dims.pp
        ep_s = 4 * (dims.ep - 1) / dims.ep * rows / dims.tp * moe.top_k * args.dim * act * moe_layers \
            / _bw(dims.ep, cluster)
    pp_s = 2 * rows / dims.tp * args.dim * act / _bw(dims.world_size, cluster) if dims.pp > 1 else 0.0
    if p.enable_async_tensor_parallel:
        tp_s /= 2
    return max(0.0, fsdp_s - compute) + hsdp_s + tp_s + cp_s + ep_s + pp_s
