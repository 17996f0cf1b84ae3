"""Muon (momentum orthogonalized by Newton-Schulz iterations) for the blocks' weight matrices, AdamW for the rest,
under any sharding of the matrices.

The orthogonalization needs each matrix whole, while FSDP, TP and EP hold shards. Per step, the matrices whose
shards several ranks hold are assigned round-robin to those ranks: one all-to-all brings each matrix's shards
to its owner, which orthogonalizes it whole (exactly once in the shard group), and a second all-to-all returns
every rank its shard of the result. Which elements of a matrix a rank holds is learned once, by sending each
shard's global element indices the same way (so any placement, uneven and strided shards included, works).
A stack of experts' matrices [experts, rows, cols] is a batch of matrices; sharded only along the experts (EP),
each rank orthogonalizes its own experts locally. Replicas (HSDP's replicate axis) each do their own.

The matrix math is `torch.optim.Muon`'s (torch 2.13: single-process, 2-D parameters only): the same quintic
iteration and coefficients, batched here over stacked experts, in a configurable dtype (bf16 as torch's; fp32
for parity tests, where bf16 rounding would amplify the last-bit differences sharded matmuls give).
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tessera.tensors import plain_tensor


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> torch.Tensor:
    """≈ U V^T of update = U S V^T (singular values mapped into about [0.7, 1.2]) for a matrix or a batch of
    them (the last two dims); torch.optim._muon._zeropower_via_newtonschulz's operations, batched."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    fma = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = fma(x, fma(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def update_scale(shape: torch.Size, rule: str) -> float:
    """The factor on lr for one matrix [rows, cols]: match_rms_adamw gives the update AdamW's typical RMS (0.2),
    so AdamW's lr carries over (Moonlight, arXiv 2502.16982); original is Keller Jordan's sqrt(max(1, rows/cols))."""
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols)) if rule == "original" else 1.0


def orthogonalize_stack(update: torch.Tensor, cfg: "MuonSettings") -> torch.Tensor:
    """A parameter's update as a batch of matrices (one for a 2-D weight): the same kernels whichever rank and
    layout, so that a matrix comes out the same wherever it is orthogonalized."""
    return orthogonalize(update.reshape(-1, *update.shape[-2:]), cfg.ns_coefficients, cfg.ns_steps,
                         cfg.ns_dtype).view(update.shape)


@dataclass(frozen=True, kw_only=True)
class MuonSettings:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    update_scale: str = "match_rms_adamw"
    ns_dtype: torch.dtype = torch.bfloat16


def muon_settings(cfg) -> MuonSettings:
    """[optimizer]'s muon_* options."""
    a, b, c = (float(x) for x in cfg.muon_ns_coefficients.split(","))
    return MuonSettings(momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                        ns_coefficients=(a, b, c), update_scale=cfg.muon_update_scale,
                        ns_dtype=getattr(torch, cfg.muon_ns_dtype))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a parameter's: the plain weight inside float8/MX wrappers), sharing storage."""
    t = plain_tensor(t)
    return t._local_tensor if isinstance(t, DTensor) else t


def _split_axes(p: torch.Tensor) -> tuple[int, ...]:
    """The mesh axes that split `p`'s matrices (not only its stack of experts): their ranks gather each one."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(axis for axis, placement in enumerate(p.placements)
                 if isinstance(placement, Shard | _StridedShard) and placement.dim % p.ndim >= p.ndim - 2)


class ShardGroup:
    """The ranks that together hold whole matrices of some parameters (all on one mesh, split along the same
    axes), and the all-to-all exchange that has each matrix orthogonalized by one of them. `groups` is the
    optimizer's cache of the process groups it created, by their ranks."""

    def __init__(self, sample: DTensor, axes: tuple[int, ...], groups: dict[tuple[int, ...], dist.ProcessGroup]):
        mesh = sample.device_mesh
        coords = mesh.get_coordinate()
        index = tuple(slice(None) if axis in axes else coords[axis] for axis in range(mesh.ndim))
        self.ranks = mesh.mesh[index].flatten().tolist()
        self.group = mesh.get_group(axes[0]) if len(axes) == 1 else self._new_group(self.ranks, groups)
        self.me = dist.get_rank(self.group)  # the group's order (new_group's: sorted) is the all-to-all's
        self.where: dict[int, torch.Tensor | None] = {}  # my matrix's slot -> each gathered element's flat index
        self.sizes: list[list[int]] | None = None  # [rank][slot]: how many elements of the matrix the rank holds
        self.ids: list[int] = []  # the parameters the layout was learned for

    @staticmethod
    def _new_group(ranks: list[int], groups: dict[tuple[int, ...], dist.ProcessGroup]) -> dist.ProcessGroup:
        # Created lazily by the members only; every member meets its groups in the same order (buckets sorted),
        # as new_group's local synchronization requires.
        key = tuple(ranks)
        if key not in groups:
            groups[key] = dist.new_group(ranks, use_local_synchronization=True)
        return groups[key]

    def owner(self, slot: int) -> int:
        return slot % len(self.ranks)

    def _exchange(self, outgoing: list[list[torch.Tensor]], recv_sizes: list[int],
                  like: torch.Tensor) -> list[torch.Tensor]:
        """all_to_all: outgoing[r] (flat pieces, of like's dtype) goes to the group's rank r; returns what each
        rank sent here."""
        chunks = [torch.cat([t.reshape(-1) for t in pieces]) if pieces else like.new_empty(0) for pieces in outgoing]
        recv = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, torch.cat(chunks), recv_sizes, [c.numel() for c in chunks], group=self.group)
        return list(recv.split(recv_sizes))

    def _to_owners(self, shards: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        outgoing: list[list[torch.Tensor]] = [[] for _ in self.ranks]
        for slot, shard in enumerate(shards):
            outgoing[self.owner(slot)].append(shard)
        return outgoing

    def _learn_layout(self, params: list[DTensor], shards: list[torch.Tensor]) -> None:
        """Once: the sizes of every rank's shards, and where the elements each sends here go in my matrices."""
        sizes = torch.zeros(len(self.ranks), len(params), dtype=torch.int64)
        sizes[self.me] = torch.tensor([s.numel() for s in shards])
        dist.all_reduce(sizes, group=self.group)  # small: every rank's shard sizes
        self.sizes = sizes.tolist()
        self.mine = [s for s in range(len(params)) if self.owner(s) == self.me]
        self.where = {}
        indices = [distribute_tensor(torch.arange(p.numel(), device=shards[0].device).view(p.shape), p.device_mesh,
                                     p.placements, src_data_rank=None).to_local() for p in params]
        for slot, whole in zip(self.mine, self._gather(indices), strict=True):
            # Kept only when the shards are not whole row blocks in rank order (TP's column split, strided shards)
            in_order = torch.equal(whole, torch.arange(whole.numel(), device=whole.device))
            self.where[slot] = None if in_order else whole

    def _gather(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """My matrices, flat, each rank's shard after the other (in the order _learn_layout's indices came)."""
        recv_sizes = [sum(row[s] for s in self.mine) for row in self.sizes]
        got = self._exchange(self._to_owners(shards), recv_sizes, shards[0])
        pieces = [chunk.split([row[s] for s in self.mine]) for chunk, row in zip(got, self.sizes, strict=True)]
        return [torch.cat([p[k] for p in pieces]) for k in range(len(self.mine))]

    def orthogonalize(self, params: list[DTensor], updates: list[torch.Tensor],
                      cfg: MuonSettings) -> list[torch.Tensor]:
        """This rank's shard of the orthogonalized update of each parameter, given its shard of each update."""
        if self.sizes is None or self.ids != [id(p) for p in params]:  # the same parameters each step, normally
            self.ids = [id(p) for p in params]
            self._learn_layout(params, updates)
        outgoing: list[list[torch.Tensor]] = [[] for _ in self.ranks]
        for slot, received in zip(self.mine, self._gather(updates), strict=True):
            where = self.where[slot]
            whole = received
            if where is not None:
                whole = torch.empty_like(received)
                whole[where] = received
            done = orthogonalize_stack(whole.view(params[slot].shape), cfg).to(received.dtype).reshape(-1)
            back = done if where is None else done[where]  # in the order the shards came
            for r, piece in enumerate(back.split([row[slot] for row in self.sizes])):
                outgoing[r].append(piece)
        recv_sizes = [sum(self.sizes[self.me][s] for s in range(len(params)) if self.owner(s) == r)
                      for r in range(len(self.ranks))]
        got = self._exchange(outgoing, recv_sizes, updates[0])
        mine = {r: list(chunk.split([self.sizes[self.me][s] for s in range(len(params)) if self.owner(s) == r]))
                for r, chunk in enumerate(got)}
        return [mine[self.owner(s)].pop(0).view(u.shape) for s, u in enumerate(updates)]


class Muon(torch.optim.AdamW):
    """Param groups with `muon: True` step by Muon (decoupled weight decay, lr scaled per matrix by
    `update_scale`), the others by AdamW (torch's, fused or foreach as configured). State is per parameter and
    shaped like it (Muon: momentum_buffer; AdamW: step, exp_avg, exp_avg_sq), so torch's distributed
    optimizer state dicts save and reshard it as they do AdamW's."""

    def __init__(self, params, settings: MuonSettings, **adamw):
        super().__init__(params, **adamw)
        self.settings = settings
        self._shard_groups: dict[tuple, ShardGroup] = {}
        self._process_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # what ShardGroups created, by ranks
        self._buckets: dict[int, tuple] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._adamw_groups():
            super().step()
        self._muon_step([g for g in self.param_groups if g.get("muon")])
        return loss

    @contextlib.contextmanager
    def _adamw_groups(self):
        """AdamW's methods see only its groups (the Muon ones have no Adam state)."""
        groups = self.param_groups
        try:
            self.param_groups = [g for g in groups if not g.get("muon")]
            yield
        finally:
            self.param_groups = groups

    def __setstate__(self, state):  # load_state_dict: AdamW's defaults and step tensors for its own groups only
        torch.optim.Optimizer.__setstate__(self, state)
        with self._adamw_groups():
            super().__setstate__({"state": self.state, "param_groups": self.param_groups})

    def _bucket(self, p: torch.Tensor) -> tuple:
        """The parameters orthogonalized together: () for whole matrices here, else (mesh, its ranks, split axes)."""
        if id(p) not in self._buckets:
            axes = _split_axes(p)
            self._buckets[id(p)] = (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.mesh.flatten().tolist()),
                                    axes) if axes else ()
        return self._buckets[id(p)]

    def _muon_step(self, groups: list[dict]) -> None:
        cfg = self.settings
        buckets: dict[tuple, list] = {}  # shard group -> [(group, param, this rank's update)]
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(plain_tensor(p))
                buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
                buf.lerp_(grad, 1 - cfg.momentum)
                update = grad.lerp(buf, cfg.momentum) if cfg.nesterov else buf.clone()
                buckets.setdefault(self._bucket(p), []).append((group, p, update))
        for key in sorted(buckets, key=str):
            entries = buckets[key]
            if key:
                if key not in self._shard_groups:
                    self._shard_groups[key] = ShardGroup(entries[0][1], key[2], self._process_groups)
                done = self._shard_groups[key].orthogonalize([p for _, p, _ in entries], [u for *_, u in entries], cfg)
            else:  # whole matrices here (one process, or experts split only by EP)
                done = [orthogonalize_stack(u, cfg) for *_, u in entries]
            for (group, p, _), update in zip(entries, done, strict=True):
                weight = _local(p)
                weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.add_(update, alpha=-group["lr"] * update_scale(p.shape, cfg.update_scale))
