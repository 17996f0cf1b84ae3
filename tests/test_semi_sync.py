"""Semi-synchronous replica groups (fault_tolerance.semi_sync_method): DiLoCo and LocalSGD against a reference in
plain PyTorch, LocalSGD every step with SGD against synchronous groups, a whole-job restart, a group SIGKILLed
mid-window. Each replica group is its own launch, as in a real job."""

import copy
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tessera.data import build_dataloader
from tests import replica_groups as local
from tests.replica_groups import kill, wait_for
from tests.test_fault_tolerance import final_weights, finish, ft_flags, rows, start_group, start_single

pytest.importorskip("torchft")

STEPS = 6
DILOCO = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2"]


@pytest.fixture
def lighthouse():
    server, address = local.start_lighthouse()
    yield address
    server.shutdown()


def reference(argv: list[str], groups: int, ranks: int, method: str, sync_steps: int, steps: int = STEPS,
              outer: tuple[float, float] = (0.7, 0.9), streaming: tuple[int, int, float] = (1, 0, 0.0),
              group_weights: list | None = None) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """(final weights, each group's per-step losses) of `groups` groups in plain PyTorch, group g taking the
    samples of data-parallel ranks g x ranks .. g x ranks + ranks - 1 (what its FSDP ranks read): inner steps with
    the run's optimizer (AdamW, or SGD) and schedule, clipped at training.max_norm; every sync_steps the weights
    averaged (local_sgd) or the averaged pseudo-gradient applied by an outer Nesterov SGD (diloco). "sync": one
    model, its gradients averaged over the groups every step (synchronous replica groups). `streaming`: diloco's
    (fragments, delay, alpha): every sync_steps / fragments steps one fragment's pseudo-gradient, taken `delay`
    steps before it is applied, and each group's own weights mixed back in by alpha; `group_weights` gets each
    group's final weights."""
    from tessera.ft.semisync import fragments
    from tessera.optim import build_lr_scheduler
    from tests.dist_worker import _trainer

    with tempfile.TemporaryDirectory() as dump:
        tr = _trainer(argv, steps, dump)  # in-process, one rank: the seed's initial weights, the tokenizer
    cfg, o = tr.cfg, tr.cfg.optimizer
    models = [copy.deepcopy(tr.step_parts.model) for _ in range(1 if method == "sync" else groups)]
    loaders = [[build_dataloader(cfg, tr.tokenizer, g * ranks + r, groups * ranks) for r in range(ranks)]
               for g in range(groups)]
    inner = [torch.optim.SGD(m.parameters(), lr=o.lr, weight_decay=o.weight_decay) if o.name == "SGD" else
             torch.optim.AdamW(m.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                               weight_decay=o.weight_decay) for m in models]
    schedules = [build_lr_scheduler(opt, cfg.lr_scheduler, steps) for opt in inner]
    synced = copy.deepcopy(tr.step_parts.model)  # the weights at the last sync, stepped by the outer optimizer
    outer_sgd = torch.optim.SGD(synced.parameters(), lr=outer[0], momentum=outer[1], nesterov=True)
    losses: list[list[float]] = [[] for _ in range(groups)]
    parts = [[name for name, _ in part] for part in fragments(synced, streaming[0], None)]
    per, delay, alpha = sync_steps // streaming[0], streaming[1], streaming[2]
    pending = None
    for step in range(1, steps + 1):
        for g in range(groups):
            model, m = (models[0], 0) if method == "sync" else (models[g], g)
            batches = [loader.next_batch() for loader in loaders[g]]
            tokens, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
            (loss / groups if method == "sync" else loss).backward()
            losses[g].append(loss.item())
            if method == "sync" and g < groups - 1:
                continue  # the groups' gradients add up: their mean
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
            inner[m].step()
            schedules[m].step()
            inner[m].zero_grad()
        if method == "sync":
            synced = models[0]
            continue
        if method == "diloco":
            params = [dict(m.named_parameters()) for m in models]
            if step % per == (per - delay) % per:
                names = parts[((step + delay) // per - 1) % len(parts)]
                with torch.no_grad():
                    pending = {n: sum(dict(synced.named_parameters())[n] - q[n] for q in params) / groups
                               for n in names}
            if step % per == 0 and pending is not None:
                with torch.no_grad():
                    for name, p in synced.named_parameters():
                        p.grad = pending.get(name)
                    outer_sgd.step()
                    outer_sgd.zero_grad(set_to_none=True)
                    for q in params:
                        for name in pending:
                            own = q[name].clone()
                            q[name].copy_(dict(synced.named_parameters())[name]).lerp_(own, alpha)
                pending = None
            continue
        if step % sync_steps:
            continue
        with torch.no_grad():
            for name, p in synced.named_parameters():
                mine = [dict(m.named_parameters())[name] for m in models]
                p.copy_(sum(mine) / groups)
            for m in models:
                m.load_state_dict(synced.state_dict())
    if group_weights is not None:
        group_weights += [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
    return {n: p.detach().clone() for n, p in synced.named_parameters()}, losses


def assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert got.keys() >= want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=tol, rtol=0, msg=name)


def start_job(dump: Path, lighthouse: str, *args: str, nproc: int = 0, stall: str = "") -> list:
    """Two replica groups: of `nproc` ranks (torchrun), or of one process (0); `stall`: group 0 (of one process)
    sleeps before a step (tests/faults.py's TESSERA_TEST_STALL, "0:step:seconds")."""
    flags = [ft_flags(lighthouse, i, min_size=2) for i in range(2)]
    return [start_group(nproc, dump, *args, *flags[i]) if nproc else
            start_single(dump, *args, *flags[i], delay=0.0, TESSERA_TEST_STALL=stall if i == 0 else "")
            for i in range(2)]


def run_job(dump: Path, lighthouse: str, *args: str, nproc: int = 0, stall: str = "") -> list[str]:
    """Two replica groups to the end; their logs."""
    return [finish(proc) for proc in start_job(dump, lighthouse, *args, nproc=nproc, stall=stall)]


@pytest.mark.ranks
def test_local_sgd_equals_the_reference_and_every_step_with_sgd_equals_synchronous_groups(tmp_path, lighthouse):
    """LocalSGD every 3 steps (groups of one process) equals the reference; LocalSGD every step with plain SGD
    (no clipping) equals synchronous replica groups with SGD (gradients averaged every step, in plain PyTorch)."""
    local_sgd = ["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "3",
                 "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(STEPS)]
    sgd = ["--optimizer.name", "SGD", "--optimizer.lr", "0.1", "--training.max_norm", "1e9", "--training.steps", "4",
           "--checkpoint.enable", "--checkpoint.interval", "4"]
    server, other = local.start_lighthouse()  # the two jobs at once, each with its own lighthouse
    try:
        procs = [*start_job(tmp_path / "local", lighthouse, *local_sgd),
                 *start_job(tmp_path / "every", other, *sgd, "--fault_tolerance.semi_sync_method", "local_sgd",
                            "--fault_tolerance.sync_steps", "1")]
        for proc in procs:
            finish(proc)
    finally:
        server.shutdown()
    want, _ = reference([], groups=2, ranks=1, method="local_sgd", sync_steps=3)
    assert_weights(final_weights(tmp_path / "local" / "checkpoint" / "replica_1"), want)
    synchronous, _ = reference(sgd, groups=2, ranks=1, method="sync", sync_steps=1, steps=4)
    assert_weights(final_weights(tmp_path / "every" / "checkpoint" / "replica_0"), synchronous)


@pytest.mark.ranks
def test_streaming_diloco_equals_the_reference(tmp_path, lighthouse):
    """Streaming DiLoCo: 2 fragments, each sent one step before it is applied, alpha 0.5 (groups of one
    process): each group's final weights equal the reference's. Group 0 stalls 4 s before step 2, so group 1 waits
    at its sync of step 3 longer than quorum_timeout_seconds (1): a sync waits for the others (sync_wait_seconds),
    and every sync commits."""
    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4",
            "--fault_tolerance.num_fragments", "2", "--fault_tolerance.fragment_sync_delay", "1",
            "--fault_tolerance.fragment_update_alpha", "0.5", "--training.steps", "8", "--checkpoint.enable",
            "--checkpoint.interval", "8", "--fault_tolerance.quorum_timeout_seconds", "1"]
    run_job(tmp_path / "job", lighthouse, *args, stall="0:2:4")
    last = [rows(tmp_path / "job", g)[-1] for g in range(2)]
    assert [(r["ft/syncs"], r["ft/failed_syncs"]) for r in last] == [(4, 0), (4, 0)], last
    groups: list = []
    reference([], groups=2, ranks=1, method="diloco", sync_steps=4, steps=8, streaming=(2, 1, 0.5),
              group_weights=groups)
    for g in range(2):
        assert_weights(final_weights(tmp_path / "job" / "checkpoint" / f"replica_{g}"), groups[g])


@pytest.mark.ranks
def test_diloco_two_groups_of_fsdp2_equal_the_reference_and_a_restart_resumes_exactly(tmp_path, lighthouse):
    """2 groups x FSDP 2, DiLoCo every 2 steps for 3 windows, saved at step 3 (mid-window) and 6: the weights and
    each group's losses equal the plain PyTorch reference, and the metrics count the syncs and the bytes sent.
    Relaunched with step 6 gone, both groups resume step 3 from their own checkpoints (the outer momentum and
    last-sync weights with it, resharded as DTensors) and repeat 4-6 bit for bit."""
    dump = tmp_path / "job"
    args = [*DILOCO, "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "3",
            "--checkpoint.last_save_model_only", "false"]
    run_job(dump, lighthouse, *args, nproc=2)
    want, losses = reference([], groups=2, ranks=2, method="diloco", sync_steps=2)
    assert_weights(final_weights(dump / "checkpoint" / "replica_1"), want)
    for g in range(2):
        got = rows(dump, g)
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        for r, loss in zip(got, losses[g], strict=True):
            assert abs(r["loss"] - loss) < 1e-5, (g, r["step"])
        assert [r["ft/syncs"] for r in got] == [0, 1, 1, 2, 2, 3] and got[-1]["ft/failed_syncs"] == 0
        assert got[-1]["ft/sync_mb"] > 0 and got[-1]["ft/sync_bytes_per_token"] > 0
    assert rows(dump, 0)[-1]["ft/weights_digest"] == rows(dump, 1)[-1]["ft/weights_digest"]
    for i in range(2):  # each group saves its own: their inner optimizers differ
        shutil.rmtree(dump / "checkpoint" / f"replica_{i}" / "step-6")
    first = {i: {r["step"]: r for r in rows(dump, i)} for i in range(2)}
    second = run_job(dump, lighthouse, *args, nproc=2)
    for i in range(2):
        assert "resumed from checkpoint step 3" in second[i]
        again = rows(dump, i)[-3:]
        assert [r["step"] for r in again] == [4, 5, 6]
        for r in again:
            keys = ("loss", "grad_norm", "ft/state_digest")
            assert [r[k] for k in keys] == [first[i][r["step"]][k] for k in keys], (i, r["step"])


@pytest.mark.paced
def test_a_group_killed_mid_window_rejoins_at_the_next_sync(tmp_path, lighthouse):
    """DiLoCo every 4 steps, two groups of one process. Group 1 is SIGKILLed inside a window (after its step 6):
    group 0 syncs alone at step 8 (quorum 1) and goes on. Relaunched, group 1 waits for group 0's next sync, copies
    its state there (the outer state included) and takes part in it; from then on both hold the same weights after
    every sync. The order is made to happen (tests/faults.py's TESSERA_TEST_HOLD): both start once both heartbeat,
    group 1 is held after step 6 until it is killed, group 0 after step 9 until the relaunched group 1 waits in its
    quorum."""
    dump, steps = tmp_path / "job", 16
    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4", "--training.steps",
            str(steps)]
    go, back, never = (str(tmp_path / name) for name in ("go", "back", "never"))
    flags = [ft_flags(lighthouse, i) for i in range(2)]
    procs = [start_single(dump, *args, *flags[i], delay=0.0, TESSERA_TEST_HOLD=hold)
             for i, hold in enumerate([f"1:{go},10:{back}", f"1:{go},7:{never}"])]
    step_of = lambda g: rows(dump, g)[-1]["step"] if rows(dump, g) else 0  # noqa: E731
    try:
        wait_for("both groups heartbeat", lambda: local.lighthouse_counts(lighthouse)[1] == 2, procs)
        Path(go).touch()  # both join then: neither forms a quorum alone
        wait_for("group 1 held after step 6", lambda: step_of(1) == 6, procs)
        kill(procs[1])
        wait_for("group 0 held after step 9", lambda: step_of(0) == 9, procs[:1])
        procs[1] = start_single(dump, *args, *flags[1], delay=0.0)
        wait_for("the relaunched group 1 waits in its quorum", lambda: local.lighthouse_counts(lighthouse)[0] == 1,
                 procs)
        Path(back).touch()
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill(proc)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, procs[1].log.read_text()[-3000:]
    a, back_rows = rows(dump, 0), rows(dump, 1)[6:]
    assert [r["step"] for r in a] == list(range(1, steps + 1)) and [r["step"] for r in rows(dump, 1)[:6]] == \
        list(range(1, 7))
    # Group 0 synced alone at step 8, copied nothing, and every sync committed.
    assert [(r["step"], r["ft/quorum"]) for r in a if r["step"] % 4 == 0] == [(4, 2), (8, 1), (12, 2), (16, 2)]
    assert a[-1]["ft/recoveries"] == 0 and (a[-1]["ft/syncs"], a[-1]["ft/failed_syncs"]) == (4, 0)
    # Group 1 rejoined at the sync of step 12, which it took part in, and holds group 0's weights after each sync.
    assert [r["step"] for r in back_rows] == [13, 14, 15, 16] and back_rows[0]["ft/recoveries"] == 1
    assert "recovered step 12" in procs[1].log.read_text()
    ours = {r["step"]: r["ft/weights_digest"] for r in a}
    assert back_rows[-1]["ft/weights_digest"] == ours[16] and back_rows[-1]["ft/syncs"] == 2


@pytest.mark.ranks
def test_a_sync_that_fails_in_one_group_fails_in_every_group(tmp_path, lighthouse):
    """DiLoCo every 2 steps; group 1's vote on its 2nd sync is no (its sync failed): group 0 does not apply that sync
    either, so both count one failed sync and hold the same weights after every sync."""
    import socket

    args = [*DILOCO, "--training.steps", "8", "--fault_tolerance.log_state_digest"]
    flags = [ft_flags(lighthouse, i, min_size=2) for i in range(2)]
    procs = [start_single(tmp_path / "job", *args, *flags[i], delay=0.0, TESSERA_TEST_REFUSE_COMMIT="2" if i else "")
             for i in range(2)]
    said = [line.split("] ", 1)[1] for line in finish(procs[0]).splitlines() if "the sync failed" in line]
    finish(procs[1])
    assert said == [f"fault tolerance: step 4: the sync failed (it failed in replica group 1 ({socket.gethostname()} "
                    f"pid {procs[1].pid})); not applied (the fragment is reset to the weights of the last sync)"]
    last = [rows(tmp_path / "job", g) for g in range(2)]
    assert [(r[-1]["ft/syncs"], r[-1]["ft/failed_syncs"]) for r in last] == [(3, 1), (3, 1)]
    digests = [{r["step"]: r["ft/weights_digest"] for r in rows_ if r["step"] % 2 == 0} for rows_ in last]
    assert digests[0] == digests[1]


@pytest.mark.paced
def test_groups_stopped_at_different_steps_agree_when_relaunched_together_or_one_after_the_other(tmp_path):
    """Two DiLoCo groups (every 4 steps) stop on SIGTERM at different steps: group 1 after step 6, then group 0,
    alone from its sync of step 8 on, after step 11, with the lighthouse (tessera.lighthouse), which serves on through
    that first SIGTERM. Each saves the step it reached (exit 143). Then, from copies of that folder:
    - both relaunched at once (a fresh lighthouse): group 1, behind, copies group 0 in their first quorum and neither
      syncs there (a group syncing alone would fail after timeout_seconds);
    - group 1 relaunched first (the lighthouse left up), trained alone to its sync of step 8, where group 0, relaunched
      meanwhile from step 11, joins: group 1 copies group 0 and, as group 0 is not at a sync, neither syncs there (a
      line says so), where group 1 sent alone and waited for a transfer that never came.
    Either way no sync fails, the weights are equal at every sync, and the losses are those of both groups relaunched
    from group 0's checkpoint. The order is made to happen (tests/faults.py's TESSERA_TEST_HOLD), not paced."""
    import os
    import signal

    dump, ref, together, late = (tmp_path / name for name in ("job", "ref", "together", "late"))
    args = [*DILOCO[:2], "--fault_tolerance.sync_steps", "4", "--training.steps", "16", "--checkpoint.enable",
            "--checkpoint.interval", "4"]
    flags = lambda address, i: [*ft_flags(address, i), "--fault_tolerance.timeout_seconds", "5"]  # noqa: E731
    hold = lambda *pairs: ",".join(f"{step}:{tmp_path / name}" for step, name in pairs)  # noqa: E731
    last = lambda folder, g: rows(folder, g)[-1]["step"] if rows(folder, g) else 0  # noqa: E731
    server, address = local.start_lighthouse_process(tmp_path, "--join_timeout_ms", "500")
    servers, procs = [server], [start_single(dump, *args, *flags(address, i), delay=0.0,
                                             TESSERA_TEST_HOLD=hold((1, "go"), (at, f"stop-{i}")))
                                for i, at in enumerate([11, 6])]
    try:
        wait_for("both groups heartbeat", lambda: local.lighthouse_counts(address)[1] == 2, [*procs, server])
        (tmp_path / "go").touch()  # both join at once: neither trains alone from the start
        for g, at in ((1, 6), (0, 11)):
            wait_for(f"group {g} held after step {at - 1}", lambda g=g, at=at: last(dump, g) == at - 1,
                     [procs[g], server])
            for proc in (procs[g], server) if g == 0 else (procs[g],):
                os.kill(proc.pid, signal.SIGTERM)
            (tmp_path / f"stop-{g}").touch()
            assert f"stopped on SIGTERM after step {at} of 16" in finish(procs[g], expect=143)
        assert server.poll() is None  # it serves on through the first SIGTERM
        assert [(r["step"], r["ft/quorum"]) for r in rows(dump, 0) if r["step"] % 4 == 0] == [(4, 2), (8, 1)]
        for folder in (ref, together, late):
            shutil.copytree(dump, folder)
        shutil.rmtree(ref / "checkpoint/replica_1")  # the reference: both from group 0's checkpoint
        shutil.copytree(ref / "checkpoint/replica_0", ref / "checkpoint/replica_1")
        fresh = [local.start_lighthouse_process(tmp_path, "--join_timeout_ms", "500") for _ in (ref, together)]
        servers += [proc for proc, _ in fresh]
        procs = [start_single(folder, *args, *flags(other, i), delay=0.0, TESSERA_TEST_HOLD=hold((1, f"go-{n}")))
                 for n, (folder, (_, other)) in enumerate(zip((ref, together), fresh, strict=True)) for i in range(2)]
        # Group 1 first: it trains step 7 alone and is held until group 0 waits in its first quorum.
        procs.append(start_single(late, *args, *flags(address, 1), delay=0.0, TESSERA_TEST_HOLD=hold((8, "back"))))
        for n, (_, other) in enumerate(fresh):  # each pair joins at once
            wait_for("both groups heartbeat", lambda a=other: local.lighthouse_counts(a)[1] == 2, procs)
            (tmp_path / f"go-{n}").touch()
        wait_for("group 1 held after step 7", lambda: last(late, 1) == 7, procs[-1:])
        procs.append(start_single(late, *args, *flags(address, 0), delay=0.0))
        wait_for("group 0 waits in its quorum", lambda: local.lighthouse_counts(address)[0] == 1, procs[-2:])
        (tmp_path / "back").touch()
        outs = [finish(proc) for proc in procs]
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(timeout=30) == 0 and "stopped on SIGTERM" in server.log.read_text()
    finally:
        for proc in [*procs, *servers]:
            if proc.poll() is None:
                kill(proc)
    assert "fault tolerance: step 11: no sync here: replica group 0 (" in outs[4] and "recovered step 11" in outs[4]
    assert not [out for out in outs if "the sync failed" in out], outs
    want = [{r["step"]: r["loss"] for r in rows(ref, g) if r["step"] > 11} for g in range(2)]
    for folder in (together, late):
        again = [{r["step"]: r for r in rows(folder, g) if r["step"] > 11} for g in range(2)]
        assert [again[0][16]["ft/failed_syncs"], again[1][16]["ft/failed_syncs"]] == [0, 0], folder.name
        assert all(again[0][n]["ft/weights_digest"] == again[1][n]["ft/weights_digest"] for n in (12, 16))
        for g in range(2):
            assert {n: r["loss"] for n, r in again[g].items()} == want[g], (folder.name, g)


@pytest.mark.fast
@pytest.mark.parametrize("flags, line", [
    (["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.outer_lr", "0.5"],
     "fault_tolerance.outer_lr: applies to semi_sync_method = diloco, this run is local_sgd"),
    ([*DILOCO, "--fault_tolerance.num_fragments", "3"],
     "fault_tolerance.num_fragments: 3 does not divide sync_steps 2"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "8",
      "--fault_tolerance.num_fragments", "2", "--fault_tolerance.fragment_sync_delay", "4"],
     "fault_tolerance.fragment_sync_delay: 4 is not below sync_steps / num_fragments = 4"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "8",
      "--fault_tolerance.fragment_sync_delay", "1", "--checkpoint.enable", "--checkpoint.interval", "12"],
     "checkpoint.interval: 12 is not a multiple of sync_steps / num_fragments = 8"),
])
def test_settings_that_do_not_fit_are_refused_in_one_line(flags, line):
    from tessera.config import ConfigError, parse_args
    from tessera.ft.check import check_config, check_semi_sync

    with pytest.raises(ConfigError) as err:
        check_semi_sync(parse_args(["--fault_tolerance.enable", *flags]))
    assert str(err.value).startswith(line) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^fault_tolerance.semi_sync_method: .* but fault_tolerance.enable is false"):
        check_config(parse_args(flags), None, False)


@pytest.mark.fast
def test_a_failed_transfer_is_said_in_one_line_naming_the_group_and_why(tmp_path):
    """gloo's text (a timeout, a closed connection) becomes the reason; the group is named as its lock records it."""
    from functools import partial
    from types import SimpleNamespace

    from torchft.manager import ExceptionWithTraceback

    from tessera.ft import check
    from tessera.ft.replicas import ReplicaGroup
    from tessera.schema import parse_args

    cfg = check.place_group(parse_args(["--job.dump_folder", str(tmp_path), *local.ft_flags("http://h:1", 0, 3)]))
    for rid, owner in ((1, "node7 pid 4242"), (2, "node8 pid 17")):
        (tmp_path / f"replica_{rid}").mkdir()
        (tmp_path / f"replica_{rid}" / check.LOCK).write_text(owner)
    group = SimpleNamespace(cfg=cfg, members=[0, 1])
    group.name = partial(ReplicaGroup.name, group)

    def said(error: Exception | None) -> str:
        group.manager = SimpleNamespace(errored=lambda: error and ExceptionWithTraceback(error))
        return ReplicaGroup.failure(group)
    assert said(RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed "
                             "out waiting 60000ms for recv operation to complete")) == \
        "the transfer with replica group 1 (node7 pid 4242) got no answer within fault_tolerance.timeout_seconds = 60"
    group.members = [1, 0, 2]
    assert said(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                             "[127.0.0.1]:41093")) == ("the transfer with replica groups 1 (node7 pid 4242), 2 (node8 "
                                                       "pid 17) lost its connection (a group stopped, ended or was "
                                                       "restarted)")
    assert said(ValueError("bad\nmore")) == ("the transfer with replica groups 1 (node7 pid 4242), 2 (node8 pid 17) "
                                             "failed: bad")
    assert said(None) == "another rank of this group failed"


@pytest.mark.fast
def test_fragments_hold_consecutive_layers_the_embedding_first_and_the_head_last():
    from tessera.ft.semisync import fragments

    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(4, 2)
    model.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(2, 2) for i in range(4)})
    model.norm, model.output = torch.nn.LayerNorm(2), torch.nn.Linear(2, 4)
    parts = [[name.rsplit(".", 1)[0] for name, _ in part] for part in fragments(model, 2, None)]
    assert [sorted(set(p)) for p in parts] == [["layers.0", "layers.1", "tok_embeddings"],
                                               ["layers.2", "layers.3", "norm", "output"]]


@pytest.mark.fast
def test_the_estimate_prices_the_link_between_groups():
    from tessera.config import parse_args
    from tessera.estimate.cost import Cluster, replica_sync

    def line(*flags: str) -> str:
        cfg = parse_args(["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", *flags])
        return replica_sync(cfg.fault_tolerance, 10**9, 8, 1.0, Cluster(inter_group_gbps=1.0))

    # 2 groups: each rank all-reduces its 0.5 GB of fp32 gradients, a ring's 2 x 1/2 of it, at 1 GB/s
    assert line() == ("2 replica groups at 1 GB/s per GPU between them (--inter_group_gbps): averaging the gradients "
                      "every step adds 0.5 s per step (+50%); diloco every 20 steps (fault_tolerance.semi_sync_method "
                      "= diloco would) adds 0.025 s (+2%), 20x less")
    streaming = line("--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "10",
                     "--fault_tolerance.num_fragments", "5", "--fault_tolerance.fragment_sync_delay", "1")
    assert streaming.endswith("diloco every 10 steps is hidden behind the inner steps")  # 0.1 s behind 1 step
