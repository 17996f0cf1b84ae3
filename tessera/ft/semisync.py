"""Semi-synchronous replica groups (fault_tolerance.semi_sync_method): each group takes its inner steps alone, on
its own data share, and every sync_steps the groups meet once.

local_sgd: the weights are averaged over the groups. diloco: the groups average their pseudo-gradients (the weights
at the last sync minus their own weights now) and an outer SGD with Nesterov momentum applies the average to the
weights of the last sync. Streaming DiLoCo (num_fragments > 1) syncs one fragment of consecutive layers every
sync_steps / num_fragments steps, its pseudo-gradient sent fragment_sync_delay steps before it is applied (the
transfer overlaps those inner steps), and mixes the group's own weights back in (fragment_update_alpha). The
arithmetic is torchft's DiLoCo's; the transport is torchft's Manager (quorum, all-reduce, fp8 quantized all-reduce,
commit vote, live recovery).

Why not torchft's LocalSGD and DiLoCo classes themselves: they run from the inner optimizer's hooks, in the middle of
a step, start their quorum inside the sync (so a relaunched group cannot take part in the very sync it recovers at),
pick the fragment from the count of committed syncs, and keep the last-sync weights and the outer momentum out of
the job's checkpoints. Here the schedule is the global step's, every quorum is at a step boundary, and the state is
one description (OuterState) for both the checkpoint and the live recovery.

The schedule, with per = sync_steps / num_fragments and d = fragment_sync_delay: after step n, when
n % per == (per - d) % per, the groups form a quorum (a group behind the others copies the live state here: a group
that died mid-window and was relaunched waits for this point, then takes part in the sync) and fragment
((n + d) // per - 1) % num_fragments is sent; when n % per == 0 it is applied. A quorum syncs only when all its
groups are at a sync (or copied one that is): a group relaunched between two syncs, ahead, makes it a quorum without
a sync (ReplicaGroup._check_quorum asks every group). A sync that does not commit resets the
fragment to the weights of the last sync (local_sgd: keeps the group's own weights), as torchft's classes do.
"""

import logging
import re
import time

import torch

from tessera.config import ConfigError
from tessera.tensors import like, local

log = logging.getLogger("tessera")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def allreduce_buckets(manager, tensors: list[torch.Tensor], limit_bytes: int, quantize: bool = False):
    """Start averaging `tensors` over the quorum in flat buckets of about `limit_bytes`; returns (bytes sent by
    this rank, wait): wait() blocks until done and writes the averages back into `tensors`."""
    buckets: list[list[torch.Tensor]] = []
    for t in tensors:
        last = buckets[-1] if buckets else None
        if last is None or last[0].dtype != t.dtype or sum(x.numel() for x in last) * t.element_size() > limit_bytes:
            buckets.append([t])
        else:
            last.append(t)
    pending = []
    for bucket in buckets:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        pending.append((manager.allreduce(flat, should_quantize=quantize), flat, bucket))

    def wait() -> None:
        for work, flat, bucket in pending:
            work.wait()
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    sent = sum(t.numel() * (1 if quantize else t.element_size()) for t in tensors)  # fp8 payload when quantized
    return sent, wait


class OuterState:
    """diloco: the weights at the last sync and the outer SGD (its momentum), per parameter. state_dict() is what a
    checkpoint holds (DTensors laid out like the weights, resharded on load as they are) and, local=True, what a
    recovering group copies from a live one (this rank's parts)."""

    def __init__(self, cfg, model: torch.nn.Module):
        f = cfg.fault_tolerance
        self.named = list(model.named_parameters())
        self.last_sync = {name: local(p).detach().clone() for name, p in self.named}
        self.sgd = torch.optim.SGD([p for _, p in self.named], lr=f.outer_lr, momentum=f.outer_momentum,
                                     nesterov=f.outer_nesterov and f.outer_momentum > 0)
        if f.outer_momentum > 0:  # zeros from the start: torch's first step (buffer = gradient) gives the same bits
            for _, p in self.named:
                self.sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.loaded = False  # from a checkpoint (else snapshot() takes the weights the run starts from)

    @torch.no_grad()
    def snapshot(self) -> None:
        for name, p in self.named:
            self.last_sync[name].copy_(local(p))

    def momentum(self) -> dict[str, torch.Tensor]:
        return {name: self.sgd.state[p]["momentum_buffer"] for name, p in self.named if self.sgd.state[p]}

    def state_dict(self, live: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        params = dict(self.named)
        if live:  # copies: the live group goes on training while the recovering one reads them
            return {"last_sync": {n: v.clone() for n, v in self.last_sync.items()},
                    "momentum": {n: local(v).clone() for n, v in self.momentum().items()}}
        return {"last_sync": {n: like(params[n], v) for n, v in self.last_sync.items()}, "momentum": self.momentum()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for kind, ours in (("last_sync", self.last_sync), ("momentum", self.momentum())):
            for name, value in state[kind].items():
                target, value = local(ours[name]), local(value)
                if target.data_ptr() != value.data_ptr():  # DCP loads in place
                    target.copy_(value)
        self.loaded = True


def build_outer_state(cfg, model: torch.nn.Module) -> OuterState | None:
    """The state a checkpoint holds besides the model's and the inner optimizer's: diloco's only."""
    f = cfg.fault_tolerance
    return OuterState(cfg, model) if f.enable and f.semi_sync_method == "diloco" else None


def fragments(model: torch.nn.Module, count: int, n_layers: int | None) -> list[list[tuple[str, torch.Tensor]]]:
    """The parameters in `count` fragments of consecutive layers (layers.<i>.): what comes before the first layer
    (the embedding) with the first fragment, what comes after a layer (the final norm, the output head) with the
    last."""
    named = list(model.named_parameters())
    index = [int(m.group(1)) if (m := _LAYER.search(name)) else None for name, _ in named]
    total = n_layers or max((i + 1 for i in index if i is not None), default=0)
    if count > max(total, 1):
        raise ConfigError(f"fault_tolerance.num_fragments: {count} is more than the model's {total} layers; sync in "
                          f"at most {max(total, 1)} fragments")
    out: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(count)]
    after_a_layer = False
    for (name, p), i in zip(named, index, strict=True):
        after_a_layer |= i is not None
        out[i * count // total if i is not None else (count - 1 if after_a_layer else 0)].append((name, p))
    return out


class SemiSync:
    """The syncs of one replica group (tessera.ft.replicas.ReplicaGroup calls join() before its first step and
    after_step() after each)."""

    def __init__(self, group, outer: OuterState | None):
        f = group.cfg.fault_tolerance
        self.group, self.f, self.outer = group, f, outer
        self.per = f.sync_steps // f.num_fragments
        self.delay = f.fragment_sync_delay
        self.fragments = fragments(group.saved.model, f.num_fragments, getattr(group.model_args, "n_layers", None))
        self.quantize = f.should_quantize
        if self.quantize and group.world.device.type != "cuda":
            raise ConfigError("fault_tolerance.should_quantize: torchft's quantized all-reduce runs on CUDA (triton "
                              f"kernels), this run is on {group.world.device.type}; set it to false")
        if outer is not None and not outer.loaded:
            outer.snapshot()  # the weights this run starts from (fresh, or loaded from weights alone)
        self.pending = None  # diloco: (fragment, its (name, param) pairs, their pseudo-gradients, wait)
        self.joined = False
        self.at_sync = False  # in a sync's quorum, about to send (a group recovering from this one then sends too)
        self.syncs, self.failed, self.sent_bytes, self.seconds = 0, 0, 0, 0.0

    def join(self) -> None:
        """Before this run's first step: meet the other groups. A group behind them copies the state of the one
        furthest ahead. Relaunched while the others train, it waits until they reach their next sync, copies their
        state there and takes part in that sync; relaunched with them (a whole job, each group from its own
        checkpoint, at its own step), it copies the state of the one that stopped last, which is in its join too:
        then no group syncs here, and all train every step from there alike. The same when a group ahead of one
        that trained on alone joins at that one's sync: it copies this group, and nobody syncs there."""
        self.joined, start, least, said = True, time.perf_counter(), self.f.min_replica_size, False
        while not self._quorum() and self.group.manager.num_participants() < least:
            if self.group.world.rank == 0 and not said:
                log.warning(f"fault tolerance: {self.group.manager.num_participants()} replica group(s) live, "
                            f"waiting for fault_tolerance.min_replica_size {least} before the first step")
            said = True
        self.group.note_quorum()
        if self.group.quorum_syncs:  # it copied a group at a sync: it takes part in that sync
            self._due(self.group.step)
        elif self.group.manager.errored() is not None and self.group.world.rank == 0:
            log.warning(f"fault tolerance: step {self.group.step}: the first quorum failed ({self.group.failure()}); "
                        f"this group trains on and meets the others at their next sync")
        self.seconds += time.perf_counter() - start

    def after_step(self) -> None:
        n, start = self.group.step, time.perf_counter()
        if n % self.per == (self.per - self.delay) % self.per:
            self.at_sync = True
            self._quorum()
            self.at_sync = False
            if self.group.quorum_syncs or self.group.manager.errored() is not None:  # a failed quorum fails the sync
                self._due(self.group.step)  # a group behind the others is at theirs now
            else:
                self._skipped()
        elif self.pending is not None and (n % self.per == 0 or n == self.group.cfg.training.steps):
            self._apply()  # the last step applies a fragment still in flight
        else:
            return
        self.seconds += time.perf_counter() - start

    def _skipped(self) -> None:
        """No sync at this quorum: a relaunched group joined it between two syncs (it resumed from its checkpoint
        at another point of the window, or this group copied its state): the groups sync next time."""
        step, per, at = self.group.step, self.per, (self.per - self.delay) % self.per
        if self.group.world.rank == 0:
            log.warning(f"fault tolerance: step {step}: no sync here: {self.group.name(self.group.joiners)} "
                        f"joined between two syncs (relaunched); the groups sync next at step "
                        f"{step + ((at - step) % per or per)}")

    def _quorum(self) -> bool:
        """A quorum of the live groups at this step; True when this group copied a live one's state."""
        self.group.position = self.group.saved.data.state_dict()
        manager = self.group.manager
        manager.load_state_dict({"step": self.group.step, "batches_committed": manager.batches_committed()})
        # The groups' inner steps are their own: one may reach a sync (or, relaunched, wait for the next) well
        # before the others; they are waited for as long as sync_wait_seconds says, not quorum_timeout_seconds.
        self.group.start_quorum(wait=("fault_tolerance.sync_wait_seconds", self.f.sync_wait_seconds))
        return self.group.recovered_s is not None

    def _due(self, n: int) -> None:
        """At a quorum point: send this point's fragment (and apply it now when nothing is left to overlap)."""
        if self.f.semi_sync_method == "local_sgd":
            self._average_weights()
            return
        fragment = self.fragments[((n + self.delay) // self.per - 1) % len(self.fragments)]
        with torch.no_grad():
            pseudo = [self.outer.last_sync[name] - local(p) for name, p in fragment]
        sent, wait = allreduce_buckets(self.group.manager, pseudo, self.f.bucket_mb * 2**20, self.quantize)
        self.sent_bytes += sent
        self.pending = (fragment, pseudo, wait)
        if self.delay == 0 or n == self.group.cfg.training.steps:
            self._apply()

    @torch.no_grad()
    def _apply(self) -> None:
        fragment, pseudo, wait = self.pending
        self.pending = None
        wait()
        committed = self._commit()
        alpha, last = self.f.fragment_update_alpha, self.outer.last_sync
        own = [local(p).clone() for _, p in fragment] if alpha and committed else []
        for name, p in fragment:
            local(p).copy_(last[name])
        if not committed:
            return
        self.outer.sgd.zero_grad(set_to_none=True)  # the inner step's gradients: only this fragment's are stepped
        for (_, p), g in zip(fragment, pseudo, strict=True):
            p.grad = like(p, g)
        self.outer.sgd.step()
        self.outer.sgd.zero_grad(set_to_none=True)
        for name, p in fragment:
            last[name].copy_(local(p))
        for (_, p), mine in zip(fragment, own, strict=False):  # alpha = 0: nothing to mix back
            local(p).lerp_(mine, alpha)

    @torch.no_grad()
    def _average_weights(self) -> None:
        params = [p for part in self.fragments for _, p in part]
        averaged = [local(p).clone() for p in params]
        sent, wait = allreduce_buckets(self.group.manager, averaged, self.f.bucket_mb * 2**20)
        self.sent_bytes += sent
        wait()
        if self._commit():
            for p, mean in zip(params, averaged, strict=True):
                local(p).copy_(mean)

    def _commit(self) -> bool:
        """One outcome for every group of the sync: this group's vote (torchft's, which its ranks share), then every
        group's vote gathered; it commits only when all voted for it. A vote that does not arrive (a group failed in
        the sync) fails it everywhere, so no group applies a sync another reset. A failed sync says why in a line."""
        manager, group = self.group.manager, self.group
        vote = manager.should_commit()
        votes = torch.zeros(max(manager.num_participants(), 1), device=group.world.device)
        votes[manager.participating_rank() or 0] = float(vote)
        from torch.distributed import ReduceOp
        manager.allreduce(votes, reduce_op=ReduceOp.SUM).wait()
        refused = [rid for rid, v in zip(group.members, votes.tolist(), strict=False) if v != 1.0]
        committed = vote and manager.errored() is None and not refused
        if not committed and group.world.rank == 0:
            kept = ("the fragment is reset to the weights of the last sync" if self.f.semi_sync_method == "diloco"
                    else "each group keeps its own weights")
            log.warning(f"fault tolerance: step {group.step}: the sync failed ({self._why(vote, refused)}); not "
                        f"applied ({kept})")
        self.syncs, self.failed = self.syncs + committed, self.failed + (not committed)
        self.group.note_quorum()
        return committed

    def _why(self, vote: bool, refused: list[int]) -> str:
        manager, least = self.group.manager, self.f.min_replica_size
        if manager.errored() is None and not vote and manager.num_participants() < least:
            return f"quorum {manager.num_participants()} group(s), below fault_tolerance.min_replica_size {least}"
        if manager.errored() is None and vote:
            return f"it failed in {self.group.name(refused)}"
        return self.group.failure()
