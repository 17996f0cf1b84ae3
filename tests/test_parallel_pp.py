"""Pipeline parallel: every schedule, PP x FSDP, PP x TP x FSDP, accumulation, and checkpoint moves,
each equal to a single-process run (fp32, same seed and data)."""

import pytest

from tessera.config.sections import PP_SCHEDULES
from tests.dist_worker import run_train
from tests.launch import assert_matches, one_process, resume_copy, run_cases

TOL = 1e-5
STEPS = 5
SCHEDULES = PP_SCHEDULES
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.fixture(scope="module")
def reference():
    return one_process(["--training.local_batch_size", "8"], STEPS)


def _csv(path):
    """A hand-written GPipe: all forwards, then all full backwards, one stage per rank, 8 micro-batches."""
    rows = [",".join([f"{s}F{m}" for m in range(8)] + [f"{s}B{m}" for m in range(8)]) for s in (0, 1)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.ranks
def test_pp2_every_schedule_csv_and_accumulation(tmp_path, reference):
    """And PP 2 alone in bf16 computes in bf16 (autocast, as one process without FSDP does): its losses are within
    2% of one bf16 process and not those of fp32."""
    cases = [[*PP2, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_schedule", s]
             for s in SCHEDULES]
    cases.append([*PP2, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_schedule_csv",
                  _csv(tmp_path / "gpipe.csv")])
    cases.append([*PP2, "--training.local_batch_size", "4", "--training.global_batch_size", "8"])
    bf16 = ["--training.local_batch_size", "8", "--training.mixed_precision_param", "bfloat16"]
    *results, pp_bf16 = run_cases(2, [*cases, [*PP2, *bf16]], STEPS)
    assert_matches(pp_bf16, one_process(bf16, STEPS), 2e-2, what=())
    assert max(abs(a - b) for a, b in zip(pp_bf16["losses"], reference["losses"], strict=True)) > 1e-4
    for name, got in zip([*SCHEDULES, "csv", "accumulation"], results, strict=True):
        try:
            assert_matches(got, reference, TOL, what=("grads", "params"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.ranks
def test_pp2_x_fsdp2(tmp_path, reference):
    """Gradients reduced at the step's end (torch's way) and after each micro-batch (with gradient accumulation
    too); and the split-backward (zero bubble) schedules, whose blocks would otherwise be resharded after forward
    and lose the weight gradients of micro-batches whose input pass came after a later forward (ZBV: both layers
    on one rank's two middle stages), even when asked to reshard always (the root too)."""
    pp_fsdp = [*PP2, "--training.local_batch_size", "4"]
    each = ["--parallelism.pipeline_parallel_grad_reduce", "microbatch"]
    interleaved = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    cases = [[*pp_fsdp, *interleaved], [*pp_fsdp, *interleaved, *each],
             [*pp_fsdp, *each, "--training.local_batch_size", "2", "--training.global_batch_size", "8"]]
    schedule = "--parallelism.pipeline_parallel_schedule"
    cases += [[*pp_fsdp, schedule, "ZBVZeroBubble"],
              [*pp_fsdp, schedule, "InterleavedZeroBubble", "--parallelism.fsdp_reshard_after_forward", "always"]]
    for name, got in zip(("step", "microbatch", "microbatch, accumulation", "ZBVZeroBubble",
                          "InterleavedZeroBubble, always resharded"),
                         run_cases(4, cases, STEPS), strict=True):
        try:
            assert_matches(got, reference, TOL, what=("grads", "params"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.ranks
def test_pp2_x_tp2_x_fsdp2(tmp_path, reference):
    (got,) = run_cases(8, [[*PP2, "--training.local_batch_size", "4",
                                      "--parallelism.tensor_parallel_degree", "2"]], STEPS)
    assert_matches(got, reference, TOL, what=("grads", "params"))


@pytest.mark.ranks
def test_pp2_checkpoint_resumes_without_pp_and_under_fsdp(tmp_path):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]
    (full,) = run_cases(2, [["--job.dump_folder", str(tmp_path / "pp"), *PP2,
                                       "--training.local_batch_size", "8", *ckpt]], 8, mode="train")
    one = run_train(["--job.dump_folder", str(resume_copy(tmp_path / "pp", tmp_path / "one", 4)),
                     "--training.local_batch_size", "8", *ckpt], 8)
    (fsdp,) = run_cases(2, [["--job.dump_folder", str(resume_copy(tmp_path / "pp", tmp_path / "fsdp", 4)),
                                       "--training.local_batch_size", "4", *ckpt]], 8, mode="train")
    for resumed in (one, fsdp):
        assert resumed["start"] == 4
        for step in range(5, 9):
            assert abs(resumed["losses"][step] - full["losses"][step]) <= TOL
        assert_matches({"losses": [], "params": resumed["params"]}, {"losses": [], "params": full["params"]}, TOL,
                       what=("params",))


def test_split_backward_schedules_reduce_at_the_end(tmp_path):
    from types import SimpleNamespace

    from tessera.parallel.pp import reduces_each_microbatch

    def cfg(schedule="1F1B", csv="", reduce="microbatch"):
        return SimpleNamespace(parallelism=SimpleNamespace(pipeline_parallel_schedule=schedule,
                                                           pipeline_parallel_schedule_csv=csv,
                                                           pipeline_parallel_grad_reduce=reduce))

    (tmp_path / "zb.csv").write_text("0F0,0I0,0W0\n")
    assert reduces_each_microbatch(cfg()) and reduces_each_microbatch(cfg(csv=_csv(tmp_path / "gpipe.csv")))
    assert not reduces_each_microbatch(cfg(reduce="step"))
    assert not reduces_each_microbatch(cfg("ZBVZeroBubble"))
    assert not reduces_each_microbatch(cfg(csv=str(tmp_path / "zb.csv")))


def test_a_model_with_two_block_stacks_is_cut_across_both():
    """A family may name several block stacks (Flux: double, then single blocks): pipelining numbers their
    blocks in forward order across stacks, each stage keeps its own, and the view has the whole model's names."""
    import torch
    from torch import nn

    from tessera.parallel.pp import cut, parts_view

    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Linear(4, 4), nn.Linear(4, 4)
            self.doubles = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(2)})
            self.singles = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(3)})

    with torch.device("meta"):
        model = TwoStacks()
    stacks = ("doubles", "singles")
    first = cut(model, [0, 1, 2], blocks=stacks, drop=("head",))
    last = cut(model, [3, 4], blocks=stacks, drop=("embed",))
    assert (list(first.doubles), list(first.singles), first.head) == (["0", "1"], ["0"], None)
    assert (list(last.doubles), list(last.singles), last.embed) == ([], ["1", "2"], None)
    view = parts_view([first, last], ("embed", "head"), stacks)
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in model.named_parameters()]
