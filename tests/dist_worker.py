"""Runs training cases in one launch and saves per-step losses and step-1 gradients (full tensors).

    torchrun --nproc_per_node=N tests/dist_worker.py OUT.pt STEPS -- <case 1 flags> -- <case 2 flags> ...

The same `run_case` runs in-process for the single-process reference.
"""

import sys
import tempfile

import torch

from tessera.config import parse_args
from tessera.config.validate import validate
from tessera.distributed import init_world, world_size_from_env
from tessera.parallel.tp import local
from tessera.train import build_trainer, train_step

BASE = ["--model.flavor", "tiny", "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "2",
        "--optimizer.lr", "3e-3", "--training.deterministic", "--metrics.log_freq", "1000"]


def full_grads(model) -> dict[str, torch.Tensor]:
    return {n: local(p.grad).detach().cpu().clone() for n, p in model.named_parameters()}


def run_case(argv: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        cfg = parse_args([*BASE, "--job.dump_folder", dump, "--training.steps", str(steps), *argv])
        world = init_world(validate(cfg, world_size_from_env()))
        tr = build_trainer(cfg, world)
        losses, grads = [], None
        from tessera.train import dp_mean
        for step in range(steps):
            loss, _, _ = train_step(tr)
            tr.step += 1
            losses.append(dp_mean(loss, world))
            if step == 0:
                grads = full_grads(tr.model)
        tr.metrics.close()
    return {"losses": losses, "grads": grads}


def split_cases(argv: list[str]) -> list[list[str]]:
    cases, current = [], None
    for a in argv:
        if a == "--":
            current = []
            cases.append(current)
        else:
            current.append(a)
    return cases


if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    results = [run_case(case, steps) for case in split_cases(sys.argv[3:])]
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()
