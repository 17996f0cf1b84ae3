"""One run-state contract (tessera/checkpoint/run_state.py): a checkpoint and a replica group's live recovery hold
the same named parts, each in the same form where it is not laid out like the model; a live copy restores every
part bit for bit."""

import pytest
import torch

from tessera.checkpoint.manager import checkpoint_state
from tessera.checkpoint.plain import read_train
from tessera.checkpoint.run_state import Progress, Saved
from tessera.config import JobConfig
from tessera.config.sections import LOADABLE_PARTS
from tessera.ft.replicas import live_state, load_live_state
from tessera.ft.semisync import OuterState
from tessera.optim import build_lr_scheduler

pytestmark = pytest.mark.fast


class Position:
    """A loader's position, as the training loaders keep it."""

    def __init__(self, index: int):
        self.index = index

    def state_dict(self) -> dict:
        return {"sample_index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["sample_index"]


def saved(seed: int, diloco: bool, steps: int = 3) -> Saved:
    """A tiny run's state after `steps` steps of AdamW (and, with `diloco`, one outer step)."""
    torch.manual_seed(seed)
    cfg = JobConfig()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, 10)
    outer = OuterState(cfg, model) if diloco else None
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if outer is not None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        outer.sgd.step()
        outer.snapshot()
    torch.randn(seed + 1)  # the generator moved on
    return Saved(model=model, optimizer=optimizer, scheduler=scheduler, data=Position(8 * steps),
                 progress=Progress(steps, 100 * steps, seed), outer=outer, device=torch.device("cpu"))


def checkpoint_parts(state: dict) -> dict:
    """A full checkpoint's state by part name, its "train" blob opened."""
    return {**{k: v for k, v in state.items() if k != "train"}, **read_train(state["train"])}


@pytest.mark.parametrize("diloco", [False, True])
def test_the_checkpoint_and_the_live_recovery_hold_the_same_parts(diloco):
    run = saved(0, diloco)
    ckpt = checkpoint_parts(checkpoint_state(run.parts()))
    live = live_state(run, ["job", "settings"], run.data.state_dict(), copy=diloco)
    assert live.pop("job") == ["job", "settings"]  # checked before anything is copied
    assert list(live) == [part.name for part in run.parts()] and set(ckpt) == set(live)
    assert set(LOADABLE_PARTS) <= set(ckpt) - {"model"}  # checkpoint.exclude_from_loading names parts
    assert ("semi_sync" in ckpt) == diloco
    for part in run.parts():  # a part not laid out like the model has one form
        if not part.laid_out:
            assert type(live[part.name]) is type(ckpt[part.name])
            if isinstance(ckpt[part.name], dict):
                assert live[part.name].keys() == ckpt[part.name].keys(), part.name
    assert live["rng"].keys() == {"cpu", "cuda"}
    assert live["model"].keys() == ckpt["model"].keys()


def flat(state) -> list:
    """Every leaf of a state dict, tensors as bytes, in order."""
    if isinstance(state, dict):
        return [(k, leaf) for k, v in state.items() for leaf in flat(v)]
    if isinstance(state, list | tuple):
        return [leaf for v in state for leaf in flat(v)]
    if isinstance(state, torch.Tensor):
        return [(str(state.dtype), tuple(state.shape), state.numpy().tobytes())]
    return [state]


@pytest.mark.parametrize("diloco", [False, True])
def test_a_live_copy_restores_every_part_bit_for_bit(diloco):
    live, behind = saved(0, diloco), saved(1, diloco, steps=1)
    sent = live_state(live, ["job", "settings"], live.data.state_dict(), copy=diloco)
    want = flat(live_state(live, ["job", "settings"], live.data.state_dict(), copy=True))
    torch.randn(7)  # this process's generator (the recovering group's) moves on: the load sets it back
    load_live_state(behind, sent)
    assert flat(live_state(behind, ["job", "settings"], behind.data.state_dict(), copy=True)) == want
    assert behind.optimizer.param_groups[0]["lr"] == live.optimizer.param_groups[0]["lr"]
