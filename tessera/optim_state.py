"""Adam / AdamW with their moments kept in bf16 between steps (`optimizer.state_dtype = "bfloat16"`): half of
the optimizer state's bytes. Parameters, gradients and the update stay fp32: each parameter's moments are widened
to fp32 for its update (one parameter at a time, so the transient is one parameter's fp32 moments) and rounded
back to bf16 after it."""

import torch
from torch.optim.adam import adam

MOMENTS = ("exp_avg", "exp_avg_sq")


class Bf16MomentsMixin:
    """Before a class of torch.optim.Adam (AdamW included): its step for moments stored in `state_dtype`."""

    state_dtype = torch.bfloat16

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:  # the trainer computes the loss itself
            raise NotImplementedError("optimizer.state_dtype = bfloat16: step() takes no closure")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, bool(group["fused"]))

    def _update(self, p: torch.Tensor, group: dict, fused: bool) -> None:
        state = self.state[p]
        if not state:  # as torch's Adam makes it: the step count on the device only for fused or capturable
            on_device = fused or group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            for key in MOMENTS:
                state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        for key in MOMENTS:  # Optimizer.load_state_dict casts state to the parameter's dtype: back to ours
            if state[key].dtype != self.state_dtype:
                state[key] = state[key].to(self.state_dtype)
        wide = [state[key].float() for key in MOMENTS]
        adam([p], [p.grad], wide[:1], wide[1:], [], [state["step"]], foreach=False, capturable=group["capturable"],
             differentiable=False, fused=fused, decoupled_weight_decay=group["decoupled_weight_decay"],
             amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        for key, value in zip(MOMENTS, wide, strict=True):
            state[key].copy_(value)


def with_state_dtype(cls: type, state_dtype: str) -> type:
    """`cls` (torch.optim.Adam or AdamW), or its subclass keeping moments in bf16 (state_dtype "bfloat16")."""
    if state_dtype == "float32":
        return cls
    return type(f"{cls.__name__}Bf16Moments", (Bf16MomentsMixin, cls), {})


def state_bytes(param_bytes: int, numel: int, state_dtype: str) -> int:
    """Bytes of Adam's state for a parameter shard: two moments (fp32 like the parameter, or bf16) and a step."""
    return 2 * (param_bytes if state_dtype == "float32" else numel * 2) + 4
