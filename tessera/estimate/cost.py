"""A step's time on a cluster, from its FLOPs and its communication. Simple on purpose, every term below:

- compute: the step's training FLOPs per device (6 N + attention, the family's count, times the tokens of the
  step) plus what activation checkpointing recomputes (full: the blocks' forward again, +1/3; selective op:
  about half of it, +1/6; selective N: +1/(3N)), over peak x MFU (the share of peak the matmuls reach).
- pipeline bubble: compute x (PP - 1) / (micro-batches x stages per rank); zero-bubble schedules (and V-shaped
  ones) fill two thirds of it.
- communication, per device, at the bandwidth of the link its group spans (one node: `intra_gbps`, NVLink;
  more: `inter_gbps`, the network), and how much of it compute hides:
  FSDP all-gathers the bf16 parameters and reduce-scatters the fp32 gradients, (group - 1) / group of them. The
  dense parameters (attention, norms, embeddings, dense and shared FFNs, routers) are sharded over data x context
  parallel ranks; the routed experts, split over EP ranks first, only over the data-parallel ranks left to each
  (data x context x tensor / EP: none at all when EP takes them all). Without PP: a gather forward, again backward
  (when resharded) and a reduce-scatter every micro-batch, prefetched behind that micro-batch's compute: only what
  exceeds it shows. Under PP (torch's schedules keep parameters gathered after the first backward and reduce once
  at the end of the step): a gather per warm-up forward and for the first backward, each hidden behind one
  micro-batch's compute, and the reduce-scatter after the last backward, hidden behind that backward only; with
  `pipeline_parallel_grad_reduce = microbatch` (not under zero-bubble schedules, which reduce at the step's end),
  every micro-batch gathers and reduce-scatters as without PP, its forward hiding the forward's gather and its
  backward the backward's gather and the reduce-scatter.
  HSDP adds an all-reduce of the gradient shards across replicas (exposed).
  TP (sequence parallel): per layer and micro-batch, 4 all-gathers / reduce-scatters of the residual stream
  forward and 4 backward, (TP - 1) / TP of it each; exposed (async TP hides half).
  CP: per layer, allgather: an all-gather of keys and values forward and a reduce-scatter of their gradients
  backward; ulysses: all-to-alls of queries, keys, values and the output, forward and backward (`cp_bytes`);
  exposed. EP: per MoE layer, tokens x top-k rows to their experts and back, forward and backward; exposed.
  Full activation checkpointing runs the forward's TP, CP and EP collectives again in backward.
  PP: each micro-batch's boundary activations and their gradients, at each of a rank's stages; exposed.

What it ignores (see the README's "What the time model ignores"): compute and communication of one rank sharing the
GPU (NCCL kernels slow the matmuls they overlap); uneven expert loads (the step waits for the busiest EP rank; under
even routing, as the estimate traces); MFU falling with small micro-batches and few tokens per expert; the first
gather and last reduce that no compute hides; network congestion and the topology beyond node / not node.
"""

import dataclasses
import math

from tessera.parallel.pp import reduces_each_microbatch
from tessera.parallel.pp_layout import MULTI_STAGE


@dataclasses.dataclass
class Cluster:
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # dense bf16 of an H100/H200
    mfu: float = 0.4
    intra_gbps: float = 450.0  # GB/s per GPU inside a node (NVLink)
    inter_gbps: float = 50.0  # GB/s per GPU between nodes (400 Gb/s)
    inter_group_gbps: float = 12.5  # GB/s per GPU between fault-tolerance replica groups (100 Gb/s)


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


def routed_params(args, counts) -> int:
    """Parameters of the routed experts (0 for a dense model): those a token does not use are params - active,
    (E - k) / E of them."""
    moe = getattr(args, "moe", None)
    if moe is None or moe.n_experts <= moe.top_k:
        return 0
    return (counts.params - counts.active) * moe.n_experts // (moe.n_experts - moe.top_k)


def cp_bytes(method: str, dims, args, rows: float, act: int = 2) -> float:
    """Bytes a rank sends per attention layer, forward and backward, for context parallel attention over `rows`
    of its tokens (parallelism.context_parallel_method). allgather: its keys and values to the CP - 1 other
    ranks, and their gradients back; ulysses: (CP - 1) / CP of its queries, keys and values (key heads repeated
    where CP does not divide them) and of attention's output, and their gradients. A family whose all-gather CP
    gathers other tensors (DSA's latent, V4's entries) says how many elements per token in `args.cp_gathered(tp)`."""
    if dims.cp == 1:
        return 0.0
    gathered = getattr(args, "cp_gathered", lambda tp: None)(dims.tp)  # a family whose CP gathers other tensors
    if method != "ulysses" and gathered is not None:
        return 2 * (dims.cp - 1) * rows * gathered * act
    head_dim = getattr(args, "head_dim", args.dim // args.n_heads)
    kv = getattr(args, "n_kv_heads", args.n_heads) / dims.tp
    if method == "ulysses":
        kv = math.lcm(max(1, int(kv)), dims.cp)
        attention = 2 * (dims.cp - 1) / dims.cp * rows * (2 * args.n_heads / dims.tp + 2 * kv) * head_dim * act
    else:
        attention = 2 * (dims.cp - 1) * rows * 2 * kv * head_dim * act
    if not hasattr(args, "linear_k_heads"):
        return attention
    full = sum(not args.linear(i) for i in range(args.n_layers)) / args.n_layers  # a hybrid: per layer, on average
    return full * attention + (1 - full) * _linear_cp_bytes(method, dims, args, rows, act)


def _linear_cp_bytes(method: str, dims, args, rows: float, act: int) -> float:
    """A linear-attention (Gated DeltaNet) layer's: ulysses sends (CP - 1) / CP of its per-token inputs (q, k, v, a,
    b) and outputs, and their gradients; all-gather CP passes states (tessera.parallel.cp.StatePassing): each rank's two
    chunks' [value heads, dk, dk + dv] in fp32 to the CP - 1 others, and their gradients, whatever the length."""
    k_heads, v_heads = args.linear_k_heads / dims.tp, args.linear_v_heads / dims.tp
    dk, dv = args.linear_k_dim, args.linear_v_dim
    if method == "ulysses":
        per_token = 2 * k_heads * dk + 2 * v_heads * dv + 2 * v_heads
        return 2 * (dims.cp - 1) / dims.cp * rows * per_token * act
    return 2 * (dims.cp - 1) * 2 * v_heads * dk * (dk + dv) * 4


def cp_method(dims, args, rows: float = 1.0) -> str:
    """The context parallel method that sends fewer bytes (the same group's links carry either; the time model
    exposes both): ulysses where the heads divide by TP x CP and its all-to-alls move less than all-gather's keys
    and values, which is for CP > (query heads + key heads after repeats) / key heads per rank. `rows`: a rank's
    tokens of a sequence (a hybrid's DeltaNet layers pass states under all-gather CP, whatever the length). A family
    whose `args.takes_ulysses` is false (keys a query selects span the sequence) runs all-gather."""
    ranks = dims.tp * dims.cp
    if dims.cp == 1 or args.n_heads % ranks or getattr(args, "linear_k_heads", ranks) % ranks \
            or not getattr(args, "takes_ulysses", True):
        return "allgather"
    return "ulysses" if cp_bytes("ulysses", dims, args, rows) < cp_bytes("allgather", dims, args, rows) \
        else "allgather"


def step_time(cfg, dims, args, counts, grad_accum: int, cluster: Cluster) -> StepTime:
    """`counts`: the family's parameter and FLOP counts (tessera.models.contract.Counts) at the run's seq_len."""
    t, p = cfg.training, cfg.parallelism
    n_micro = t.local_batch_size // p.pipeline_parallel_microbatch_size if dims.pp > 1 else 1
    per_rank_stages = 2 if p.pipeline_parallel_schedule in MULTI_STAGE else 1
    tokens = t.local_batch_size * t.seq_len * dims.dp * grad_accum
    flops = counts.flops_per_token * tokens
    ac = cfg.activation_checkpoint
    compute = flops / dims.world_size * (1 + recompute_share(ac.mode, ac.selective_ac_option)) \
        / (cluster.peak_tflops * 1e12 * cluster.mfu)
    bubble = compute * bubble_share(p.pipeline_parallel_schedule, dims.pp, n_micro, per_rank_stages)
    exposed = _fsdp(cfg, dims, args, counts, grad_accum, compute / (grad_accum * n_micro), n_micro, cluster) \
        + _activations_comm(cfg, dims, args, grad_accum, per_rank_stages, cluster)
    seconds = compute + bubble + exposed
    return StepTime(compute, bubble, exposed, seconds, tokens / dims.world_size / seconds, flops)


def _fsdp(cfg, dims, args, counts, grad_accum: int, micro_compute: float, n_micro: int, cluster: Cluster) -> float:
    """Exposed seconds of FSDP's gathers and reductions (and HSDP's all-reduce); `micro_compute`: one micro-batch's
    compute (forward and backward)."""
    routed = routed_params(args, counts)
    dense_group, expert_group = dims.dp_shard * dims.cp, dims.dp_shard * dims.cp * dims.tp // max(dims.ep, 1)
    # Each rank's share of a stage's parameters before FSDP shards them, and the ranks FSDP shards them over.
    groups = [((counts.params - routed) / (dims.pp * dims.tp), dense_group),
              (routed / (dims.pp * dims.ep), expert_group)]
    bw = _bw(dims.dp_shard * dims.cp * dims.tp, cluster)  # both groups span the data x context x tensor ranks
    gather = sum(2 * n * (g - 1) / g for n, g in groups if g > 1) / bw  # bf16
    reduce = sum(4 * n * (g - 1) / g for n, g in groups if g > 1) / bw  # fp32
    shard = sum(4 * n / g for n, g in groups)
    hsdp = 2 * (dims.dp_replicate - 1) / dims.dp_replicate * shard / _bw(dims.world_size // dims.pp, cluster)
    passes = 1 if cfg.parallelism.fsdp_reshard_after_forward == "never" else 2
    if dims.pp == 1:
        per_batch = max(0.0, passes * gather + reduce - micro_compute)
    elif reduces_each_microbatch(cfg):  # each micro-batch gathers and reduces as without PP, but between stages'
        # work its forward hides only the forward's gather, its backward the backward's gather and the reduction
        per_batch = n_micro * (max(0.0, gather - micro_compute / 3)
                               + max(0.0, (passes - 1) * gather + reduce - 2 * micro_compute / 3))
    else:  # gathers for the warm-up forwards (1F1B: up to PP of them) and the first backward, then kept
        gathers = min(n_micro, dims.pp) + 1
        per_batch = gathers * max(0.0, gather - micro_compute / 3) + max(0.0, reduce - 2 * micro_compute / 3)
    return grad_accum * per_batch + hsdp  # per_batch: one local batch, all its micro-batches


def replica_sync(f, params: int, ranks_per_replica: int, step_s: float, cluster: Cluster) -> str | None:
    """Under fault tolerance with several replica groups: one line on what the link between the groups costs per
    step, averaging the gradients every step against fault_tolerance's semi-synchronous method (DiLoCo at its
    sync_steps when none is set). Each rank all-reduces its fp32 part of the model (params / the ranks of one
    replica) with its peers in the other groups, a ring: 2 (G - 1) / G of it; per-step groups every step, exposed;
    DiLoCo once per sync_steps (fp8 with should_quantize), a fragment's transfer hidden behind the
    fragment_sync_delay steps it overlaps. `f`: the config's fault_tolerance section."""
    if not f.enable or f.group_size < 2:
        return None
    ring = 2 * (f.group_size - 1) / f.group_size * 4 * params / ranks_per_replica / (cluster.inter_group_gbps * 1e9)
    every = ring
    method = "diloco" if f.semi_sync_method == "none" else f.semi_sync_method
    per = f.sync_steps // f.num_fragments
    fragment = ring / f.num_fragments / (4 if f.should_quantize and method == "diloco" else 1)
    semi = max(0.0, fragment - f.fragment_sync_delay * step_s) / per
    chosen = "" if f.semi_sync_method != "none" else " (fault_tolerance.semi_sync_method = diloco would)"
    saving = f"adds {semi:.3g} s (+{semi / step_s:.0%}), {every / semi:.0f}x less" if semi else \
        "is hidden behind the inner steps"
    return (f"{f.group_size} replica groups at {cluster.inter_group_gbps:g} GB/s per GPU between them "
            f"(--inter_group_gbps): averaging the gradients every step adds {every:.3g} s per step "
            f"(+{every / step_s:.0%}); {method} every {f.sync_steps} steps{chosen} {saving}")


def _activations_comm(cfg, dims, args, grad_accum: int, per_rank_stages: int, cluster: Cluster) -> float:
    """Exposed seconds of the collectives on activations: TP, CP, EP, PP."""
    t, p = cfg.training, cfg.parallelism
    act = 2  # bytes per activation element (bf16)
    layers = args.n_layers / dims.pp
    rows = t.local_batch_size * grad_accum * t.seq_len / dims.cp  # tokens a rank's CP/TP group runs per step
    again = 1.5 if cfg.activation_checkpoint.mode == "full" else 1.0  # forward collectives run again in backward
    tp_s = 8 * (dims.tp - 1) / dims.tp * rows * args.dim * act * layers / _bw(dims.tp, cluster)
    cp_s = cp_bytes(p.context_parallel_method, dims, args, rows) * layers / _bw(dims.cp * dims.tp, cluster)
    moe = getattr(args, "moe", None)
    ep_s = 0.0
    if moe is not None and dims.ep > 1:
        moe_layers = moe.n_sparse(args.n_layers) / dims.pp
        ep_s = 4 * (dims.ep - 1) / dims.ep * rows / dims.tp * moe.top_k * args.dim * act * moe_layers \
            / _bw(dims.ep, cluster)
    pp_s = 2 * per_rank_stages * rows / dims.tp * args.dim * act / _bw(dims.world_size, cluster) if dims.pp > 1 \
        else 0.0
    if p.enable_async_tensor_parallel:
        tp_s /= 2
    return again * (tp_s + cp_s + ep_s) + pp_s
