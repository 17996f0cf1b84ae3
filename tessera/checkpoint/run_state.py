"""The run's state as one list of named parts. What a checkpoint holds (checkpoint/manager.py) and what a replica
group recovering from a live one copies (ft/replicas.py) are both made from `Saved.parts()`, so a piece of state is
added here once (tests/test_run_state.py fails when the two cover different pieces).

Each part has two forms. state_dict / load_state_dict: a checkpoint's, through DCP (tensors laid out as in
training, DTensors resharded on load). local_state_dict / load_local_state_dict: a live peer's, which torchft sends
as it is (this rank's shards as plain tensors; `copy`: cloned, for a peer that goes on training while they are
read). A part whose state is not laid out like the model (step counters, lr schedule, data position, RNG) has one
form; a checkpoint keeps those parts together in one blob, "train" (plain.py: train_blob). The part names are those
checkpoint.exclude_from_loading takes.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from tessera.checkpoint.plain import model_state, optimizer_state
from tessera.config import ConfigError
from tessera.optim import keep_settings
from tessera.parallel.init import bare_name
from tessera.tensors import like, local

DATA = "dataloader"  # the part a replica group sends as of the start of the step it runs (ft/replicas.py)


@dataclass
class Progress:
    """The step counters a full checkpoint holds (its train_state); the Trainer counts in this one."""
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0  # training.nonfinite_policy = skip: steps not applied


class Part:
    """A named piece of the run's state. `laid_out`: its tensors are laid out like the model's (a DCP entry of
    its own, resharded on load); else it is one entry of the checkpoint's "train" blob, the same in both forms."""
    name = ""
    laid_out = False

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, state: Any) -> None:
        raise NotImplementedError

    def local_state_dict(self, copy: bool) -> Any:
        return self.state_dict()

    def load_local_state_dict(self, state: Any) -> None:
        self.load_state_dict(state)


def _taker(copy: bool):
    return (lambda v: local(v).clone()) if copy else local


class ModelPart(Part):
    """The weights and buffers (an MoE model's expert biases, which the balancer updates), but not the frozen
    weights (LoRA's base), which come from checkpoint.initial_load_path or the seed as the run starts."""
    name, laid_out = "model", True

    def __init__(self, model: nn.Module):
        self.model = model
        self.frozen = frozenset(bare_name(n) for n, p in model.named_parameters() if not p.requires_grad)

    def state_dict(self) -> dict:
        state = model_state(self.model)  # plain tensors, whatever wraps the weights
        return {k: v for k, v in state.items() if k not in self.frozen}

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.frozen))

    def local_state_dict(self, copy: bool) -> dict:
        take = _taker(copy)
        return {k: take(v) for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def load_local_state_dict(self, state: dict) -> None:
        ours = self.model.state_dict()
        if ours.keys() != state.keys():
            raise ConfigError("fault_tolerance: the live replica group holds another model (its parameter names "
                              "differ); every group runs the same config")
        for name, value in state.items():
            target = local(ours[name])
            if target.shape != value.shape:
                raise ConfigError(f"fault_tolerance: the live replica group's '{name}' has shape {list(value.shape)} "
                                  f"on this rank, this group {list(target.shape)}; every group runs the same model "
                                  f"and layout")
            target.copy_(value)


class OptimizerPart(Part):
    """The optimizer's state; its settings stay this run's (a setting changed on resume is applied)."""
    name, laid_out = "optimizer", True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return optimizer_state(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        built = [dict(group) for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state)
        keep_settings(self.optimizer, built)

    def local_state_dict(self, copy: bool) -> dict:
        take, opt = _taker(copy), self.optimizer.state_dict()
        sharded = [(i, k) for i, s in opt["state"].items() for k, v in s.items() if isinstance(v, DTensor)]
        return {"state": {i: {k: take(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for i, s in opt["state"].items()},
                "param_groups": opt["param_groups"], "sharded": sharded}

    @torch.no_grad()
    def load_local_state_dict(self, state: dict) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for i, key in state.pop("sharded"):
            state["state"][i][key] = like(params[i], state["state"][i][key].to(params[i].device))
        built = [dict(group) for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        keep_settings(self.optimizer, built)


class ProgressPart(Part):
    name = "train_state"

    def __init__(self, progress: Progress):
        self.progress = progress

    def state_dict(self) -> dict:
        return dataclasses.asdict(self.progress)

    def load_state_dict(self, state: dict) -> None:
        self.progress.step, self.progress.tokens_seen = state["step"], state["tokens_seen"]
        self.progress.skipped_steps = state.get("skipped_steps", 0)  # checkpoints from before it was counted


class SchedulerPart(Part):
    """The lr schedule, continued at its step over this run's training.steps and peak lr (optim.Schedule)."""
    name = "lr_scheduler"

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)  # optim.Schedule continues it with this run's peaks


class Stateful(Part):
    """An object that keeps its own state (state_dict / load_state_dict): the training loader's position (global:
    any layout resumes it)."""

    def __init__(self, name: str, obj):
        self.name, self.obj = name, obj

    def state_dict(self) -> dict:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.obj.load_state_dict(state)


class RngPart(Part):
    """torch's CPU generator and the run's CUDA device's (named: torchft asks for the state from its own thread,
    whose current device may be another)."""
    name = "rng"

    def __init__(self, device: torch.device | None):
        self.cuda = device if device is not None and device.type == "cuda" else "cuda"

    def state_dict(self) -> dict:
        return {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(self.cuda) if torch.cuda.is_available() else None}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"], self.cuda)


class OuterPart(Stateful):
    """fault_tolerance diloco: the outer optimizer and the weights at the last sync (ft/semisync.py: OuterState,
    whose live form is always a copy)."""
    laid_out = True

    def local_state_dict(self, copy: bool) -> dict:
        return self.obj.state_dict(live=True)


@dataclass(frozen=True)
class Saved:
    """What a checkpoint holds and a recovering replica group copies, by name (parts()): the checkpointer and the
    replica group are given this, not the Trainer."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: Any  # the training loader: its position (state_dict / load_state_dict)
    progress: Progress
    bos_id: int | None = None  # the tokenizer's: Hugging Face exports' config.json names them
    eos_id: int | None = None
    outer: Any = None  # fault_tolerance diloco: the outer optimizer and the weights at the last sync (OuterState)
    device: torch.device | None = None  # the run's: whose CUDA RNG state is saved

    def parts(self) -> list[Part]:
        """The run's state, in the order it is loaded (the optimizer before the lr schedule, which sets its lr)."""
        parts = [ModelPart(self.model), OptimizerPart(self.model, self.optimizer), ProgressPart(self.progress),
                 SchedulerPart(self.scheduler), Stateful(DATA, self.data), RngPart(self.device)]
        return parts + ([OuterPart("semi_sync", self.outer)] if self.outer is not None else [])
