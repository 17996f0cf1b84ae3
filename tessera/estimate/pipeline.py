"""What a pipeline rank holds over one step: the order of its forward and backward actions, as torch's schedules
run them, and the activations that order keeps alive at once."""

import dataclasses

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineScheduleRuntime, get_schedule_class


@dataclasses.dataclass
class StageCost:
    """Bytes of one stage: `grads` what its first backward of the step leaves for the rest of it (gradients); per
    micro-batch `act` kept from its forward to its backward (the trainer has the schedule keep no outputs),
    `input_grad` its input's gradient (kept in the receive buffer until the next step); `first` needed by the first
    backward beyond the held activations (the gradients it makes included), `transient` by a later one beyond held
    activations and gradients, `end` by the gradients' reduction after the last backward."""
    grads: int
    act: int
    input_grad: int
    first: int
    transient: int
    end: int


def orders(stages: list, cfg, n_micro: int) -> dict[int, list[tuple[str, int, int]]] | None:
    """{pp rank: [(action "F", "B", "I" or "W", stage index, micro-batch)]} of a multi-stage schedule (or a CSV one),
    from torch's own `pipeline_order`; None for the single-stage schedules (GPipe, 1F1B: see `single_order`).
    `stages`: this rank's PipelineStage objects (the order of every rank is computed from them)."""
    p = cfg.parallelism
    if p.pipeline_parallel_schedule_csv:
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=n_micro, loss_fn=_no_loss, scale_grads=False)
        schedule._load_csv(p.pipeline_parallel_schedule_csv)
    else:
        cls = get_schedule_class(p.pipeline_parallel_schedule)
        if issubclass(cls, PipelineScheduleSingle):
            return None
        schedule = cls(stages, n_microbatches=n_micro, loss_fn=_no_loss, scale_grads=False)
    return {rank: _flatten(actions) for rank, actions in schedule.pipeline_order.items()}


def _no_loss(out, target):
    return out


def _flatten(actions) -> list[tuple[str, int, int]]:
    out = []
    for a in actions:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):
            kind = sub.computation_type.value
            if kind in ("F", "B", "I", "W"):
                out.append((kind, sub.stage_index, sub.microbatch_index))
    return out


def single_order(schedule: str, stage: int, n_stages: int, n_micro: int) -> list[tuple[str, int, int]]:
    """GPipe: every forward, then every backward. 1F1B: min(n_micro, n_stages - stage) forwards, then one
    backward and one forward in turn (torch's Schedule1F1B)."""
    if schedule == "GPipe":
        return [("F", stage, i) for i in range(n_micro)] + [("B", stage, i) for i in range(n_micro)]
    warmup = min(n_micro, n_stages - stage)
    order = [("F", stage, i) for i in range(warmup)]
    for i in range(n_micro):
        order.append(("B", stage, i))
        if warmup + i < n_micro:
            order.append(("F", stage, warmup + i))
    return order


def held(order: list[tuple[str, int, int]], costs: dict[int, StageCost]) -> tuple[int, int]:
    """(the most bytes a rank needs over the step beyond its parameters, optimizer state and receive buffers, the
    most micro-batches' activations it holds at once). Gradients appear with each stage's first backward (the
    step starts without: zero_grad frees them); a full backward (B) frees its micro-batch's activations; a
    zero-bubble input backward (I) keeps the graph until its weight backward (W)."""
    current = peak = count = most = 0
    started = set()
    for kind, stage, _ in order:
        c = costs[stage]
        if kind == "F":
            current, count = current + c.act, count + 1
            peak, most = max(peak, current), max(most, count)
            continue
        if kind in ("B", "I"):
            if stage in started:
                peak = max(peak, current + c.transient)
            else:
                peak = max(peak, current + c.first)
                current += c.grads
                started.add(stage)
            current += c.input_grad
        if kind in ("B", "W"):
            current, count = current - c.act, count - 1
    return max(peak, current + max((costs[s].end for s in costs), default=0)), most
