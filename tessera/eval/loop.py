"""In-loop evaluation: the [eval] tasks of lm-eval-harness on the live model every `eval.interval` steps and at
the end. Every rank takes part: each data-parallel rank answers its share of the requests with the model as it
is sharded (tessera.eval.lm; under pipelining through the schedule, the last stage's results shared with the
others), rank 0 gathers and logs `eval/<task>/<metric>` and `eval/seconds`. Nothing of the
run changes: the random generators' states are restored after it, and what MoE layers counted of its tokens is
dropped (the expert-bias update counts training tokens only)."""

import contextlib
import logging
import random
import time
from collections.abc import Callable

import numpy as np
import torch

from tessera.experts import moe_layers, reset_statistics
from tessera.step import StepParts, pipeline_outputs


def evaluator(cfg, tokenizer, log: Callable[[int, dict], None], step: StepParts) -> Callable | None:
    """The trainer's `evaluate` hook (RunView, last step) -> whether it ran; None without eval.tasks. `log(step,
    values)`: the run's metrics under `eval/`; `step`: what a training step runs (its pipeline schedule)."""
    if not cfg.eval.tasks:
        return None
    from tessera.eval.lm import TesseraLM, lm_tokenizer
    from tessera.eval.tasks import evaluate, scores, task_manager

    tokens, manager = lm_tokenizer(tokenizer), task_manager(cfg.eval.tasks)

    def run(view, last: bool) -> bool:
        every = cfg.eval.interval
        if not (last or (every and view.step % every == 0)):
            return False
        start, group = time.perf_counter(), view.world.flat["dp"].get_group() if view.world.dims.dp > 1 else None
        lm = TesseraLM(view.model, tokens, batch_size=cfg.eval.batch_size, max_length=cfg.training.seq_len,
                       max_gen_toks=cfg.eval.max_gen_toks, group=group, width_multiple=view.world.dims.tp,
                       cp_group=view.world.mesh["cp"].get_group() if view.world.dims.cp > 1 else None,
                       **(_pipelined(step, cfg.training) if step.pipeline is not None else {}))
        view.model.eval()
        try:
            with _rng_kept(view.world.device), _quiet("lm_eval"), view.autocast:
                results = evaluate(lm, cfg, manager)
        finally:
            view.model.train()
            reset_statistics(moe_layers(view.model))
        log(view.step, {**scores(results), "seconds": time.perf_counter() - start})
        return True

    return run


def _pipelined(step: StepParts, training) -> dict:
    """TesseraLM's `forward` and `stage_group` under pipelining: rows run through the schedule in batches of the
    training's shape (right-padded; a causal model's positions never see what follows them)."""
    shape = training.local_batch_size, training.seq_len

    def forward(ids: torch.Tensor) -> torch.Tensor | None:
        outs = []
        for start in range(0, len(ids), shape[0]):
            rows = ids[start:start + shape[0]]
            batch = torch.zeros(shape, dtype=ids.dtype, device=ids.device)
            batch[:len(rows), :rows.shape[1]] = rows
            out = pipeline_outputs(step, batch)
            outs.append(out[:len(rows), :rows.shape[1]] if out is not None else None)
        return torch.cat(outs) if step.pipeline.last else None

    return {"forward": forward, "stage_group": step.pipeline.group}


@contextlib.contextmanager
def _quiet(name: str):
    """lm-eval's info lines (tasks built, requests run) left out of the training log; its warnings stay."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _rng_kept(device: torch.device):
    """lm-eval seeds Python's, NumPy's and torch's generators: the run's states come back after it."""
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    random.setstate(states[0])
    np.random.set_state(states[1])
