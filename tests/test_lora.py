"""LoRA ([lora], tessera/lora.py): the base frozen, adapters beside the target linears, each layout equal to one
process, and bad input refused in one line."""

import json
import shutil
import tempfile

import pytest
import torch

from tessera.config import ConfigError
from tessera.preflight import validate
from tessera.schema import parse_args
from tests.dist_worker import BASE, _trainer
from tests.launch import ROOT, assert_matches, merge, one_process, run_cases

LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "wq,wv,attention.wo,feed_forward.w2"]
BATCH = ["--training.local_batch_size", "8"]
# Qwen 3 MoE with adapters on attention and on every expert's gate, up and down stacks (the balancing bias off:
# Hugging Face's format has no place for it)
MOE_LORA = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--moe.load_balance_rate", "0",
            *LORA[:4], "--lora.target_modules", "wq,attention.wo,experts.w1,experts.w2,experts.w3"]
STEPS = 3


def test_only_the_adapters_train_and_a_run_starts_from_the_base_model():
    """B starts at zero: step 1's loss is the base model's. The base gets no gradient and no optimizer state; the
    adapters' optimizer state is two moments of them. The adapted run learns (its loss falls over 12 steps)."""
    from tessera.train import train_step

    with tempfile.TemporaryDirectory() as base_dump, tempfile.TemporaryDirectory() as dump:
        base = _trainer(BATCH, 1, base_dump)
        tr = _trainer([*BATCH, *LORA, "--optimizer.lr", "1e-2"], 12, dump)
        model = tr.step_parts.model
        adapters = {n for n, p in model.named_parameters() if p.requires_grad}
        assert adapters == {f"layers.{i}.{m}.{ab}" for i in range(2) for ab in ("lora_a", "lora_b")
                            for m in ("attention.wq", "attention.wv", "attention.wo", "feed_forward.w2")}
        assert train_step(tr)[0] == pytest.approx(train_step(base)[0], abs=1e-6)
        grads = {n for n, p in model.named_parameters() if p.grad is not None}
        assert grads == adapters
        held = {p for group in tr.optimizer.param_groups for p in group["params"]}
        assert held == {p for p in model.parameters() if p.requires_grad}
        state_bytes = sum(t.numel() * t.element_size() for s in tr.optimizer.state.values() for t in s.values()
                          if t.dim())
        assert state_bytes == 2 * sum(p.numel() * p.element_size() for p in held)
        losses = [train_step(tr)[0] for _ in range(11)]
        assert sum(losses[-3:]) < sum(losses[:3]), losses
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        train_step(tr)
        assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


@pytest.mark.ranks
def test_layouts_equal_one_process():
    """2 ranks: FSDP 2, TP 2 (+SP; column-wise wq/wv split B's rows, row-wise wo/w2 split A's columns), PP 2,
    CP 2, FSDP 2 with full AC and compiled blocks (the adapters' hooks traced): losses, step-1 adapter gradients
    and final parameters within 1e-5; FSDP 2 with Float8 base linears against one process with them: losses, grad
    norms and step-1 gradients within 1e-3."""
    reference = one_process([*BATCH, *LORA], STEPS)
    assert reference["grads"] and all(n.endswith(("lora_a", "lora_b")) for n in reference["grads"])
    half = ["--training.local_batch_size", "4"]
    cases = [[*half, *LORA], [*BATCH, *LORA, "--parallelism.tensor_parallel_degree", "2"],
             [*BATCH, *LORA, "--parallelism.pipeline_parallel_degree", "2",
              "--parallelism.pipeline_parallel_microbatch_size", "2"],
             [*BATCH, *LORA, "--parallelism.context_parallel_degree", "2"],
             [*half, *LORA, "--activation_checkpoint.mode", "full", "--compile.enable"]]
    f8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"]
    *layouts, float8 = run_cases(2, [*cases, [*half, *LORA, *f8]], STEPS)
    for got in layouts:
        assert_matches(got, reference, 1e-5, what=("grads", "params"))
    # Float8 base linears: an input's scale is its rank's batch's amax, so emulated float8 rounds each rank's half of
    # the batch apart from one process's whole batch: 1e-3, the Float8 tolerance of tests/test_speed_features.py.
    assert_matches(float8, one_process([*BATCH, *LORA, *f8], STEPS), 1e-3, what=("grads",))


@pytest.mark.ranks
def test_hsdp_and_ep_equal_one_process_and_adapters_resume_on_one(tmp_path):
    """4 ranks: HSDP 2x2; Qwen 3 MoE with adapters on its attention and on every expert under EP 2 x FSDP 2 (the
    expert stacks frozen, their adapters split over experts like them): losses, step-1 adapter gradients and final
    parameters within 1e-5. Elastic: the 4 ranks' adapter checkpoint of step 2 resumed by one process trains step
    3 as the 4 ranks did."""
    from tests.dist_worker import run_train

    hsdp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    ep = [*MOE_LORA, "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"]
    dense, experts = run_cases(4, [[*LORA, "--training.local_batch_size", "2", *hsdp], ep], STEPS)
    assert_matches(dense, one_process([*BATCH, *LORA], STEPS), 1e-5, what=("grads", "params"))
    assert_matches(experts, one_process([*MOE_LORA, *BATCH], STEPS), 1e-5, what=("grads", "params"))
    assert any(".experts.w2_lora_b" in n for n in experts["grads"])
    saving = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    four, = run_cases(4, [[*ep, *saving, "--job.dump_folder", str(tmp_path / "four")]], STEPS, mode="train")
    shutil.copytree(tmp_path / "four/checkpoint/step-2", tmp_path / "one/checkpoint/step-2")
    one = run_train([*MOE_LORA, *BATCH, *saving, "--job.dump_folder", str(tmp_path / "one")], STEPS)
    assert one["start"] == 2 and one["losses"][3] == pytest.approx(four["losses"][3], abs=1e-5)


@pytest.mark.parametrize("argv, expect", [
    (["--optimizer.name", "Muon"], "optimizer.name: Muon orthogonalizes whole weight matrices"),
    (["--lora.target_modules", ""], "lora.target_modules: empty"),
    (["--job.config_file", str(ROOT / "configs/flux_debug.toml")], "lora.rank: flux takes no adapters"),
    (["--lora.alpha", "0"], r"^lora.alpha: 0 scales every adapter's update by alpha / rank = 0, so the run would "
                            r"train nothing; set it above 0 \(e.g. 16, or 2 x lora.rank = 8\)$"),
])
def test_bad_settings_are_refused_before_ranks_start(argv, expect):
    with pytest.raises(ConfigError, match=expect):
        validate(parse_args(merge(LORA, argv)), 1)


@pytest.mark.parametrize("argv, expect", [
    (["--lora.target_modules", "wq,query"], "lora.target_modules: query match.es. no linear of this model, by its "
                                             "names or Hugging Face's; name the ends of linear names, e.g. wq, wk, wv, "
                                             "wo, w1, w2, w3, output"),
    (["--lora.rank", "100"], r"lora.rank: 100 is above layers.0.attention.wq's size \(64 x 64\)"),
    (["--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--lora.target_modules", "experts.w2",
      "--checkpoint.enable", "--checkpoint.last_save_in_hf"],
     "lora: layers.0.feed_forward.experts.w2 has adapters, which PEFT cannot hold for this model; export with "
     "lora.merge_on_export = true .the final save"),
    # Qwen 3.5's DeltaNet q (block 0) is fused with k and v in its Hugging Face layout; full attention's is not
    (["--model.name", "qwen3_5", "--model.flavor", "tiny", "--lora.target_modules", "wq", "--checkpoint.enable",
      "--checkpoint.last_save_in_hf"],
     "lora: layers.0.attention.wq's weight is not stored as it is in the Hugging Face layout, so its adapter has no "
     "PEFT name; export with lora.merge_on_export"),
])
def test_targets_and_ranks_the_model_cannot_take_are_refused_before_ranks_start(argv, expect):
    """By the launch check (run_train.sh's, before torchrun), on the model built on the meta device; a rank
    started without it (torchrun -m tessera.train) refuses the same before any weight exists."""
    with pytest.raises(ConfigError, match=expect):
        validate(parse_args(merge(BASE, LORA, argv)), 1, launch=True, training=True)
    with tempfile.TemporaryDirectory() as dump, pytest.raises(ConfigError, match=expect):
        _trainer([*LORA, *argv], 1, dump)


@pytest.mark.fast
def test_hugging_face_names_of_the_linears_are_taken_as_the_models_own(caplog):
    """The names PEFT users write (transformers' modules) pick the linears the family's Hugging Face layout gives
    them, named in one line: the adapters of the model's own names. A block kind whose own projections Hugging Face
    fuses (Qwen 3.5's DeltaNet) keeps none: its full-attention blocks' q_proj alone."""
    from tessera.lora import apply_lora, targets

    cases = [([], "q_proj,v_proj,self_attn.o_proj,down_proj", ["wq", "wv", "wo", "w2"],
              "q_proj -> wq (2 linears); v_proj -> wv (2 linears); self_attn.o_proj -> wo (2 linears); down_proj -> w2 "
              "(2 linears)"),
             (["--model.name", "qwen3_5", "--model.flavor", "tiny"], "q_proj", ["layers.1.attention.wq",
                                                                             "layers.3.attention.wq"],
              "q_proj -> layers.1.attention.wq, layers.3.attention.wq (2 linears)")]
    for model, hf, ours, said in cases:
        caplog.clear()
        with caplog.at_level("INFO", logger="tessera"):
            run = validate(parse_args(merge(BASE, LORA, [*model, "--lora.target_modules", hf])), 1, launch=True,
                           training=True)
        assert run.cfg.lora.target_modules == ours
        name = run.cfg.model.name
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("lora.")] == [
            f"lora.target_modules: Hugging Face names of {name}'s linears, taken as its own: {said}"]
        with torch.device("meta"):
            built = run.family.spec().model(run.args)
        assert sorted(apply_lora(built, run.cfg.lora)) == sorted(f for f, *_ in targets(built, ours)) != []


@pytest.mark.parametrize("merged", [False, True], ids=["peft", "merged"])
def test_the_export_loads_in_peft_or_transformers_with_the_same_logits(tmp_path, merged):
    """The final Hugging Face export of a LoRA run of Qwen 3 MoE (adapters on attention and on the experts): a PEFT
    folder that peft loads onto the transformers model of the base (saved here; a run from a Hugging Face folder
    names it as base_model_name_or_path), the experts' adapters on transformers' fused gate_up_proj and down_proj
    (target_parameters); or with lora.merge_on_export the base weights with the updates folded in; logits within
    1e-5 of Tessera's. The PEFT folder imports into a new run as it was exported."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tessera.checkpoint.hf import save_hf
    from tessera.checkpoint.peft import base_state
    from tessera.checkpoint.plain import model_state
    from tessera.train import train

    flags = [*BATCH, *MOE_LORA, "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--optimizer.lr", "1e-2",
             *(["--lora.merge_on_export"] if merged else [])]
    tr = _trainer(flags, 3, str(tmp_path / "run"))
    train(tr)
    tr.metrics.close()
    export, model = tmp_path / "run/checkpoint/exports/step-3", tr.step_parts.model.eval()
    assert all(p.abs().min() > 0 for n, p in model.named_parameters() if n.endswith("lora_b"))  # B trained from 0
    if merged:
        theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    else:
        from peft import PeftModel

        assert {p.name for p in export.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
        save_hf(base_state(model_state(model)), tr.model_args, tmp_path / "base", family="qwen3_moe")
        theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base",
                                                                                dtype=torch.float32), export)
    tokens = torch.randint(0, tr.model_args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, want = model(tokens), theirs.eval()(tokens).logits
        torch.testing.assert_close(want, ours, rtol=1e-5, atol=1e-5)
    if merged:
        return
    again = _trainer([*BATCH, *MOE_LORA, "--lora.initial_adapter_path", str(export)], 1, str(tmp_path / "again"))
    trained = dict(model.named_parameters())
    loaded = {n: p for n, p in again.step_parts.model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    assert len(loaded) == 20 and all(torch.equal(p, trained[n]) for n, p in loaded.items())
    with pytest.raises(ConfigError, match="lora.rank: 8, but the adapters of lora.initial_adapter_path"):
        validate(parse_args(merge(BASE, MOE_LORA, ["--lora.rank", "8", "--lora.initial_adapter_path", str(export)])),
                 1)
    weights = export / "adapter_model.safetensors"  # gate's adapter reaching up's rows: no per-stack form
    stored = load_file(weights)
    stored["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"][-1, 0] = 1.0
    save_file(stored, weights)
    with pytest.raises(ConfigError, match="gate_up_proj's adapter in .* mixes the blocks of its fused rows"):
        _trainer([*BATCH, *MOE_LORA, "--lora.initial_adapter_path", str(export)], 1, str(tmp_path / "mixed"))


def test_checkpoints_hold_the_adapters_alone_and_a_resumed_run_equals_the_whole_one(tmp_path, caplog):
    """The base is left out of a LoRA run's checkpoints (model and optimizer state hold the adapters) and comes
    back from the seed (or checkpoint.initial_load_path) as the run resumes: 3 + 3 steps equal 6. Another rank or
    other targets are refused on resume, another alpha applies with a line."""
    from torch.distributed.checkpoint import FileSystemReader

    from tests.dist_worker import run_train

    flags = [*BATCH, *LORA, "--checkpoint.enable", "--checkpoint.interval", "3"]
    whole = run_train([*flags, "--job.dump_folder", str(tmp_path / "whole")], 6)
    shutil.copytree(tmp_path / "whole/checkpoint/step-3", tmp_path / "parts/checkpoint/step-3")  # stopped there
    resumed = run_train([*flags, "--job.dump_folder", str(tmp_path / "parts")], 6)
    assert resumed["start"] == 3 and resumed["losses"] == {s: whole["losses"][s] for s in (4, 5, 6)}
    saved = FileSystemReader(str(tmp_path / "parts/checkpoint/step-3")).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert weights and all(k.endswith(("lora_a", "lora_b")) for k in weights), weights
    moments = {k for k in saved if k.startswith("optimizer.state.")}
    assert moments and all(".lora_a." in k or ".lora_b." in k for k in moments), moments
    for change, refused in ((["--lora.rank", "8"], "lora.rank: 8, but the checkpoint at .* holds adapters of "
                                                  "lora.rank = 4"),
                            (["--lora.target_modules", "wq"], "lora.target_modules: .'wq'., but the checkpoint"),
                            (["--lora.rank", "0"], "lora.rank: 0, but the checkpoint")):
        with pytest.raises(ConfigError, match=refused):
            validate(parse_args(merge(BASE, flags, ["--job.dump_folder", str(tmp_path / "parts"),
                                                    "--training.steps", "9"], change)), 1)
    with caplog.at_level("WARNING", logger="tessera"):  # alpha changes the update's scale from here on: a line
        validate(parse_args(merge(BASE, flags, ["--job.dump_folder", str(tmp_path / "parts"), "--training.steps", "9",
                                                "--lora.alpha", "16"])), 1)
    assert "lora.alpha: 8.0 in the checkpoint at " in caplog.text and "16.0 from here on" in caplog.text


def test_estimate_counts_no_gradients_or_moments_for_the_frozen_base():
    """Gradients and AdamW's moments of the adapters alone (tests/test_estimate.py checks that the shipped 8B LoRA
    config fits one 80 GiB GPU), and backward's FLOPs without the frozen weights' gradients."""
    from tessera import lora
    from tessera.estimate.core import estimate

    flags = ["--model.flavor", "debugmodel", "--training.seq_len", "128", "--training.local_batch_size", "2",
             "--lora.rank", "16", "--lora.target_modules", "wq,wk,wv,wo,w1,w2,w3"]
    adapted, whole = (estimate(parse_args(merge(flags, more)), 1, "cuda") for more in ([], ["--lora.rank", "0"]))
    cfg = parse_args(flags)
    run = validate(cfg, 1)
    with torch.device("meta"):
        model = run.family.spec().model(run.args)
    adapters = sum(16 * (out + inp) for *_, (out, inp) in lora.targets(model, cfg.lora.target_modules))
    params = sum(p.numel() for p in model.parameters())
    kind, full = adapted.kinds[0], whole.kinds[0]
    assert abs(kind.grads / (4 * adapters) - 1) < 0.01 and abs(kind.optimizer / (8 * adapters) - 1) < 0.01, kind
    assert abs(full.grads / (4 * params) - 1) < 0.01 and abs(kind.params - full.params - 4 * adapters) < 0.01 * \
        kind.params
    assert adapted.time.compute < 0.8 * whole.time.compute


@pytest.mark.parametrize("hf", [False, True], ids=["dcp", "hf"])
def test_the_base_loads_from_a_checkpoint_without_adapters(tmp_path, hf):
    """checkpoint.initial_load_path, a DCP checkpoint or a Hugging Face folder of the whole model (no adapters):
    the base weights are its, the adapters start afresh, and the PEFT export names the folder as its base."""
    from tessera.train import train

    tr = _trainer([*BATCH, "--checkpoint.enable", *(["--checkpoint.last_save_in_hf"] if hf else [])], 2,
                  str(tmp_path / "base"))
    train(tr)
    tr.metrics.close()
    base = tmp_path / ("base/checkpoint/exports/step-2" if hf else "base/checkpoint/step-2")
    flags = [*BATCH, *LORA, "--checkpoint.enable", "--checkpoint.initial_load_path", str(base),
             *(["--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf"] if hf else [])]
    tuned = _trainer(flags, 1, str(tmp_path / "tuned"))
    want = dict(tr.step_parts.model.named_parameters())
    got = dict(tuned.step_parts.model.named_parameters())
    assert {n for n in got if n not in want} == {n for n in got if n.endswith(("lora_a", "lora_b"))}
    assert all(torch.equal(want[n], got[n]) for n in want)
    if hf:
        train(tuned)
        tuned.metrics.close()
        config = json.loads((tmp_path / "tuned/checkpoint/exports/step-1/adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base) and config["r"] == 4
