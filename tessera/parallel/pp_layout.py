"""Which layers each pipeline stage holds, and which stages each rank runs. Torch-free (checked at launch)."""

MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def num_stages(n_layers: int, pp: int, schedule: str, layers_per_stage: int, split_points: list[str],
               first_less: int, last_less: int) -> int:
    if split_points:
        return len(split_points) + 1
    if layers_per_stage:
        return -(-(n_layers + first_less + last_less) // layers_per_stage)
    return pp * (2 if schedule in MULTI_STAGE else 1)


def stage_layers(n_layers: int, n_stages: int, split_points: list[str], first_less: int,
                 last_less: int) -> list[list[int]]:
    """Layer ids per stage. The first and last stages also hold the embedding and the output, so they get
    `first_less` / `last_less` fewer layers; the remainder goes to the middle stages."""
    if split_points:
        starts = [0, *(int(p.rsplit(".", 1)[-1]) for p in split_points), n_layers]
        return [list(range(a, b)) for a, b in zip(starts, starts[1:], strict=False)]
    base, extra = divmod(n_layers + first_less + last_less, n_stages)
    sizes = [base] * n_stages
    middle = list(range(1, n_stages - 1)) or list(range(n_stages))
    for i in range(extra):
        sizes[middle[i % len(middle)]] += 1
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if n_stages == 1:
        sizes = [n_layers]
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + max(size, 0))))
        start += max(size, 0)
    return out


def rank_stages(pp_rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    """Loop style: rank r runs stages r, r + pp, ...; V style: r and n_stages - 1 - r."""
    if schedule in V_SHAPED:
        return [pp_rank, n_stages - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))


def check(n_layers: int, pp: int, schedule: str, csv: str, local_batch: int, microbatch: int,
          layers_per_stage: int, split_points: list[str], first_less: int, last_less: int) -> str | None:
    """The first problem with this pipeline layout, as a message, or None."""
    stages = num_stages(n_layers, pp, schedule, layers_per_stage, split_points, first_less, last_less)
    if stages % pp:
        return f"{stages} stages do not divide evenly over pipeline_parallel_degree {pp}"
    per_rank = stages // pp
    if not csv and (per_rank > 1) != (schedule in MULTI_STAGE):
        kind = "several stages per rank" if schedule in MULTI_STAGE else "one stage per rank"
        return f"schedule {schedule} runs {kind}, but the layout gives {per_rank}; adjust layers_per_stage"
    if schedule in V_SHAPED and per_rank != 2:
        return f"schedule {schedule} needs exactly 2 stages per rank, the layout gives {per_rank}"
    try:
        layout = stage_layers(n_layers, stages, split_points, first_less, last_less)
    except ValueError:
        return f"split points {split_points} are not layer indices"
    if sum(map(len, layout)) != n_layers or any(not ids for ids in layout[1:-1]) or \
            any(b and a and a[-1] >= b[0] for a, b in zip(layout, layout[1:], strict=False)):
        return f"{n_layers} layers cannot fill {stages} stages ({[len(x) for x in layout]} layers each)"
    if local_batch % microbatch:
        return f"local_batch_size {local_batch} is not divisible by pipeline_parallel_microbatch_size {microbatch}"
    n_micro = local_batch // microbatch
    if n_micro < stages and schedule != "GPipe":
        # torch's schedules refuse this (or, on some versions, hang); say it before any rank starts.
        return (f"{n_micro} micro-batches (local_batch_size / pipeline_parallel_microbatch_size) for {stages} "
                f"stages; {schedule} needs at least one per stage")
    if schedule in MULTI_STAGE and n_micro % pp:
        return f"{n_micro} micro-batches must be a multiple of pipeline_parallel_degree {pp} for {schedule}"
    return None
