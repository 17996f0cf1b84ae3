"""Config: defaults < TOML < CLI, every CLI form, one-line errors (exit 2, nothing written), --help, the dumped
TOML, the shipped configs, and the launch paths that check a config before any rank starts."""

import dataclasses
import logging
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tessera.config import ConfigError, to_toml
from tessera.config.manager import _flatten_toml, _leaves
from tessera.preflight import validate
from tessera.schema import JobConfig, help_text, parse_args
from tests.launch import ROOT, merge, torchrun
from tests.test_data import make_hf_folder

pytestmark = pytest.mark.fast
CONFIGS = ROOT / "configs"
LEAVES = {key: (owner, f) for key, owner, f in _leaves(JobConfig())}


def get(cfg: JobConfig, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def config_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m tessera.config ...`: the torch-free check run_train.sh runs before launching."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tessera.config", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: "), stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Precedence and types


PRECEDENCE_TOML = """
[job]
description = "from toml"

[optimizer]
lr = 1e-3

[lr_scheduler]
decay_ratio = 0.3

[training]
steps = 20
deterministic = true

[validation]
enable = true

[compile]
components = ["model"]

[checkpoint]
exclude_from_loading = ["optimizer"]

[quantize.linear.float8]
recipe_name = "rowwise"
filter_fqns = ["output", "w1"]
"""

# key: (default, value in PRECEDENCE_TOML, CLI raw value, value after CLI)
PRECEDENCE = {
    "training.steps": (10000, 20, "30", 30),  # int
    "optimizer.lr": (8e-4, 1e-3, "2e-3", 2e-3),  # float
    "training.deterministic": (False, True, "false", False),  # bool
    "job.description": ("", "from toml", "from cli", "from cli"),  # str
    "compile.components": (["model", "loss"], ["model"], "loss, model", ["loss", "model"]),  # list
    "checkpoint.exclude_from_loading": ([], ["optimizer"], "optimizer,dataloader", ["optimizer", "dataloader"]),
    "lr_scheduler.decay_ratio": (None, 0.3, "none", None),  # Optional: TOML sets it, CLI clears it
    "quantize.linear.float8.recipe_name": ("tensorwise", "rowwise", "rowwise_with_gw_hp", "rowwise_with_gw_hp"),
}


def test_precedence_default_toml_cli(tmp_path):
    toml = write(tmp_path / "c.toml", PRECEDENCE_TOML)
    defaults = parse_args([])
    from_toml = parse_args(["--job.config_file", toml])
    cli = [x for key, (_, _, raw, _) in PRECEDENCE.items() for x in (f"--{key}", raw)]
    # CLI wins over the file wherever --job.config_file sits in argv.
    from_cli = parse_args([*cli[:4], "--job.config_file", toml, *cli[4:]])
    for key, (default, in_toml, _, after_cli) in PRECEDENCE.items():
        assert get(defaults, key) == default, key
        assert get(from_toml, key) == in_toml, key
        assert get(from_cli, key) == after_cli, key
    # Keys set only in the file survive CLI overrides of other keys; untouched keys keep their defaults.
    for cfg in (from_toml, from_cli):
        assert cfg.validation.enable is True
        assert cfg.quantize.linear.float8.filter_fqns == ["output", "w1"]
        assert cfg.training.seq_len == 2048 and cfg.quantize.linear.mx.recipe_name == "mxfp8_cublas"
        assert cfg.job.config_file == toml
    assert isinstance(from_cli.training.steps, int) and isinstance(from_cli.optimizer.lr, float)
    # An Optional set on the CLI only; a second --job.config_file is refused, never silently the last one read.
    other = write(tmp_path / "d.toml", "[training]\nsteps = 7\n")
    cfg = parse_args(["--lr_scheduler.decay_ratio", "0.5", "--job.config_file", other])
    assert cfg.lr_scheduler.decay_ratio == 0.5 and cfg.training.steps == 7 and cfg.job.config_file == other
    assert cfg.validation.enable is False
    with pytest.raises(ConfigError, match="--job.config_file is given twice"):
        parse_args(["--job.config_file", toml, "--job.config_file", other])


def test_toml_types_are_converted_or_refused(tmp_path):
    ok = write(tmp_path / "ok.toml", '[optimizer]\nlr = 1\n[lr_scheduler]\ndecay_ratio = "none"\n')
    cfg = parse_args(["--job.config_file", ok])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # TOML int -> float field
    assert cfg.lr_scheduler.decay_ratio is None
    for body, key in (("[training]\nsteps = 2.5", "training.steps"), ("[training]\nsteps = true", "training.steps"),
                      ("[training]\ndeterministic = 1", "training.deterministic"),
                      ("[compile]\ncomponents = [1]", "compile.components"),
                      ("[job]\ndescription = 3", "job.description"), ('[training]\nsteps = "10"', "training.steps"),
                      ('[lr_scheduler]\ndecay_ratio = "half"', "lr_scheduler.decay_ratio")):
        path = write(tmp_path / "bad.toml", body + "\n")
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} \(in {re.escape(path)}\): expected "):
            parse_args(["--job.config_file", path])


# ---------------------------------------------------------------------------------------------------------------
# CLI forms


def test_cli_forms():
    cfg = parse_args(["--training.steps", "5", "--training.seq_len=64", "--training.deterministic",
                      "--validation.enable", "--metrics.enable_tensorboard"])
    assert (cfg.training.steps, cfg.training.seq_len) == (5, 64)
    # Bare bool followed by another flag, and bare bool at the very end of argv.
    assert cfg.training.deterministic is True and cfg.validation.enable is True
    assert cfg.metrics.enable_tensorboard is True

    cfg = parse_args(["--training.deterministic", "--training.steps", "9"])
    assert cfg.training.deterministic is True and cfg.training.steps == 9
    assert parse_args(["--training.deterministic"]).training.deterministic is True

    # Explicit booleans: =false, =true, and as a separate value (which is consumed, not a positional).
    on = parse_args(["--checkpoint.initial_load_model_only=false", "--training.deterministic=true",
                     "--validation.enable", "false", "--metrics.enable_wandb", "yes", "--training.steps", "3"])
    assert on.checkpoint.initial_load_model_only is False and on.training.deterministic is True
    assert on.validation.enable is False and on.metrics.enable_wandb is True and on.training.steps == 3
    assert parse_args(["--training.deterministic=FALSE"]).training.deterministic is False

    # Lists, empty lists, values holding '=' or starting with '-', the last occurrence winning.
    cfg = parse_args(["--compile.components", "model,loss", "--model.converters=", "--job.description=a=b",
                      "--checkpoint.load_step=-7", "--optimizer.lr", "1e-2"])
    assert cfg.compile.components == ["model", "loss"] and cfg.model.converters == []
    assert cfg.job.description == "a=b" and cfg.checkpoint.load_step == -7 and cfg.optimizer.lr == 1e-2
    assert parse_args(["--lr_scheduler.decay_ratio=0.25"]).lr_scheduler.decay_ratio == 0.25
    assert parse_args(["--lr_scheduler.decay_ratio", "NONE"]).lr_scheduler.decay_ratio is None


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the key (and file), exit 2, no dump folder


BAD_TOML = {
    "unknown_section": "[trainer]\nsteps = 3\n",
    "unknown_nested_key": '[quantize.linear.float8]\nrecipe = "rowwise"\n',
    "wrong_type": '[training]\nsteps = "many"\n',
    "wrong_type_bool": "[training]\ndeterministic = 1\n",
    "not_a_choice": '[activation_checkpoint]\nmode = "some"\n',
    "below_min": "[optimizer]\nlr = -0.1\n",
    "invalid": "[training\nsteps = 3\n",
}

# (id, args, world size, substrings of the message, also run tessera.train.main in-process at world size 1)
# "{toml}" is a file holding BAD_TOML[id]; "{tmp}" the test's tmp folder.
BAD = [
    ("unknown_section", ["--trainer.steps", "3"], 1, ["unknown option 'trainer.steps' (on the command line)"], True),
    ("unknown_section_toml", ["--job.config_file", "{toml}"], 1,
     ["unknown option 'trainer.steps' (in {toml})"], True),
    ("unknown_key", ["--training.stepz", "3"], 1,
     ["unknown option 'training.stepz' (on the command line); did you mean 'training.steps'?"], True),
    ("unknown_key_at_end", ["--training.stepz"], 1, ["did you mean 'training.steps'?"], True),
    # A mistyped bool flag must be reported as such, not swallow the next flag as its value.
    ("unknown_bool_key", ["--training.determinstic", "--training.steps", "3"], 1,
     ["unknown option 'training.determinstic'", "did you mean 'training.deterministic'?"], True),
    ("unknown_nested_key_toml", ["--job.config_file", "{toml}"], 1,
     ["unknown option 'quantize.linear.float8.recipe' (in {toml}); "
      "did you mean 'quantize.linear.float8.recipe_name'?"], True),
    ("wrong_type_cli", ["--training.steps", "many"], 1,
     ["training.steps (on the command line): expected an integer, got 'many'"], True),
    ("wrong_type_cli_float", ["--optimizer.lr", "fast"], 1, ["optimizer.lr (on the command line): expected a number"],
     True),
    ("wrong_type_cli_optional", ["--lr_scheduler.decay_ratio", "half"], 1,
     ["lr_scheduler.decay_ratio (on the command line): expected a number or none, got 'half'"], True),
    ("wrong_type_cli_bool", ["--training.deterministic=maybe"], 1,
     ["training.deterministic (on the command line): expected true or false, got 'maybe'"], True),
    ("wrong_type_toml", ["--job.config_file", "{toml}"], 1, ["training.steps (in {toml}): expected an integer"], True),
    ("wrong_type_bool_toml", ["--job.config_file", "{toml}"], 1,
     ["training.deterministic (in {toml}): expected true or false"], True),
    ("not_a_choice", ["--optimizer.name", "Lion"], 1,
     ["optimizer.name (on the command line): 'Lion' is not one of AdamW, Adam"], True),
    ("not_a_choice_toml", ["--job.config_file", "{toml}"], 1,
     ["activation_checkpoint.mode (in {toml}): 'some' is not one of none, full, selective"], True),
    ("below_min", ["--training.steps", "0"], 1, ["training.steps (on the command line): 0 is below the minimum 1"],
     True),
    ("below_min_optional", ["--lr_scheduler.decay_ratio", "-0.5"], 1,
     ["lr_scheduler.decay_ratio (on the command line): -0.5 is below the minimum"], True),
    ("below_min_toml", ["--job.config_file", "{toml}"], 1, ["optimizer.lr (in {toml}): -0.1 is below the minimum"],
     True),
    ("degrees", ["--parallelism.data_parallel_shard_degree", "3"], 4,
     ["parallelism", "multiply to 3", "world size is 4", "data_parallel_shard_degree"], False),
    ("degrees_replicate", ["--parallelism.data_parallel_replicate_degree", "3"], 4,
     ["parallelism", "does not divide the world size 4"], False),
    ("global_batch", ["--training.local_batch_size", "4", "--training.global_batch_size", "12"], 2,
     ["training.global_batch_size: 12 is not a multiple of", "4 x data-parallel degree 2 = 8"], False),
    ("global_batch_small", ["--training.local_batch_size", "4", "--training.global_batch_size", "2"], 1,
     ["training.global_batch_size: 2 is not a multiple of"], True),
    ("missing_config", ["--job.config_file", "{tmp}/nope.toml"], 1,
     ["job.config_file: no such file '{tmp}/nope.toml'"], True),
    ("invalid_toml", ["--job.config_file", "{toml}"], 1, ["job.config_file: '{toml}' is not valid TOML"], True),
    ("missing_tokenizer", ["--model.hf_assets_path", "{tmp}"], 1,
     ["model.hf_assets_path: no tokenizer.json in '{tmp}'"], True),
    ("dataset_path", ["--training.dataset", "files", "--training.dataset_path", "{tmp}/none*.txt"], 1,
     ["training.dataset_path: nothing matches '{tmp}/none*.txt'"], True),
    ("unknown_flavor", ["--model.flavor", "9B"], 1, ["model.flavor: '9B' is not a llama3 flavor", "debugmodel"],
     True),
    ("ep_without_experts", ["--model.flavor", "tiny", "--parallelism.expert_parallel_degree", "2"], 2,
     ["parallelism.expert_parallel_degree: llama3 tiny has no experts; set it to 1"], True),
    ("positional", ["steps", "3"], 1, ["unexpected argument 'steps'"], True),
    ("missing_value", ["--training.steps"], 1, ["training.steps", "missing value"], True),
]


@pytest.mark.fast
def test_launch_precheck_leaves_warnings_to_rank_0(tmp_path):
    """run_train.sh and the SLURM scripts pre-check with --errors-only: a warning (here: a resume reading other
    documents) is said once, by rank 0, not also by the pre-check."""
    from tessera.checkpoint.folder import write_marker

    step = tmp_path / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x" * 64)
    saved = parse_args([*TINY, "--training.dataset", "files", "--training.dataset_path", str(tmp_path / "old.txt")])
    (step / "config.toml").write_text(to_toml(saved))
    write_marker(str(step), 2, "full")
    (tmp_path / "new.txt").write_text("some words " * 200)
    args = ["--job.dump_folder", str(tmp_path), "--checkpoint.enable", *merge(TINY, ["--training.steps", "4"]),
            "--training.dataset", "files", "--training.dataset_path", str(tmp_path / "new.txt")]
    assert "training.dataset_path: " in config_cli("--world-size", "1", *args).stderr
    quiet = config_cli("--world-size", "1", "--errors-only", *args)
    assert (quiet.returncode, quiet.stderr) == (0, ""), quiet.stderr
    for script in ("run_train.sh", "multinode_trainer.slurm", "ft_trainer.slurm"):
        assert "--errors-only" in (ROOT / script).read_text(), script


# Enough to finish in a second should a check ever let the bad config through (the test then fails on the dump).
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "1", "--training.local_batch_size",
        "2", "--lr_scheduler.warmup_steps", "0"]


@pytest.mark.parametrize("case, args, world, expect, in_process", BAD, ids=[c[0] for c in BAD])
def test_bad_input_one_line_exit_2_no_dump(tmp_path, monkeypatch, capsys, case, args, world, expect, in_process):
    fill = {"tmp": str(tmp_path)}
    if case.removesuffix("_toml") in BAD_TOML:
        fill["toml"] = write(tmp_path / "bad.toml", BAD_TOML[case.removesuffix("_toml")])
    args = [a.format(**fill) for a in args]
    dump = tmp_path / "dump"

    proc = config_cli("--world-size", str(world), "--job.dump_folder", str(dump), *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    line = one_error_line(proc.stderr)
    for part in expect:
        assert part.format(**fill) in line, line
    assert not dump.exists()

    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--job.dump_folder", str(dump), *args]), world)
    assert line == f"tessera: {err.value}" and "\n" not in str(err.value)

    if in_process:
        from tessera.train import main

        for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            monkeypatch.delenv(var, raising=False)
        capsys.readouterr()
        assert main(merge(TINY, ["--job.dump_folder", str(dump)], args)) == 2
        out, err_text = capsys.readouterr()
        assert out == "" and err_text == line + "\n"
        assert not dump.exists()


@pytest.mark.ranks
def test_bad_config_under_torchrun_one_message_no_dump(tmp_path):
    dump = tmp_path / "dump"
    proc = torchrun(2, *TINY, "--job.dump_folder", str(dump), "--parallelism.data_parallel_shard_degree", "3",
                    timeout=240)
    assert proc.returncode != 0
    both = proc.stdout + proc.stderr
    lines = [x for x in both.splitlines() if x.startswith("tessera: ")]
    assert len(lines) == 1, both[-3000:]  # rank 0 only
    assert "parallelism: degrees multiply to 3" in lines[0] and "world size is 2" in lines[0]  # read from torchrun
    assert f'File "{ROOT / "tessera"}' not in both  # no traceback from Tessera's code
    assert not dump.exists()


def test_run_train_sh_refuses_bad_flag_before_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "LOG_RANK")}
    env.update(NGPU="2", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "run_train.sh"), "--training.stepz", "3"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    # A first-time venv setup may print (pip's warnings among it): the message is asserted, not the stream.
    lines = [x for x in proc.stderr.splitlines() if x.startswith("tessera:")
             and not x.startswith(("tessera: setting up", "tessera: reusing"))]
    # torchrun would exit 1 and print the message once more from rank 0 (and log its own start-up).
    assert proc.returncode == 2, proc.stderr
    assert lines == ["tessera: unknown option 'training.stepz' (on the command line); did you mean 'training.steps'?"]
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------------------------------------------
# --help


def check_help(text: str) -> None:
    documented = {}
    for line in text.splitlines():
        m = re.match(r"^  --(\S+) +(.*)$", line)
        if m:
            assert m.group(1) not in documented, line
            documented[m.group(1)] = m.group(2)
    assert set(documented) == set(LEAVES)
    for key, (owner, f) in LEAVES.items():
        line = documented[key]
        assert line.startswith(f.metadata["doc"]), (key, line)
        assert f"(default: {getattr(owner, f.name)!r})" in line, (key, line)
        if f.metadata["choices"]:
            assert line.endswith("{" + "|".join(f.metadata["choices"]) + "}"), (key, line)
    for section in ("[training]", "[quantize.linear.float8]", "[quantize.linear.mx]"):
        assert section in text.splitlines()


def test_help_lists_every_option(capsys):
    check_help(help_text())
    proc = config_cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    check_help(proc.stdout)
    assert config_cli("--world-size", "2", "-h").stdout == proc.stdout

    from tessera.train import main

    capsys.readouterr()
    assert main(["--help"]) == 0
    assert capsys.readouterr().out == proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# Dumped TOML


@pytest.mark.parametrize("changes", [
    [],
    ["--training.steps", "77", "--optimizer.lr", "1.5e-4", "--optimizer.eps", "1e-12", "--training.deterministic",
     "--lr_scheduler.decay_ratio", "0.25", "--compile.components", "loss", "--model.converters",
     "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise", "--quantize.linear.mx.filter_fqns",
     "", "--checkpoint.initial_load_model_only=false", "--job.description", 'quote " and \\ and ü',
     "--checkpoint.load_step", "-3"],
], ids=["defaults", "changed"])
def test_to_toml_round_trips(tmp_path, changes):
    cfg = parse_args(changes)
    text = to_toml(cfg)
    table = tomllib.loads(text)
    assert "float8" in table["quantize"]["linear"]
    dumped = write(tmp_path / "config.toml", text)
    again = parse_args(["--job.config_file", dumped])
    assert again == dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=dumped))
    if changes:
        assert again != JobConfig() and again.lr_scheduler.decay_ratio == 0.25 and again.model.converters


# ---------------------------------------------------------------------------------------------------------------
# Shipped configs


SHIPPED = sorted(p.name for p in CONFIGS.glob("*.toml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_parses(name):
    path = str(CONFIGS / name)
    cfg = parse_args(["--job.config_file", path])
    with open(path, "rb") as fh:
        for key, value in _flatten_toml(tomllib.load(fh)):
            assert get(cfg, key) == value, key


@pytest.mark.parametrize("name", ["llama3_debug.toml", "qwen3_debug.toml", "qwen3_moe_debug.toml",
                                  "deepseek_v3_debug.toml", "gpt_oss_debug.toml", "llama4_debug.toml",
                                  "qwen3_sft_debug.toml", "qwen3_5_debug.toml", "qwen3_5_moe_debug.toml"])
def test_debug_config_validates_at_world_size_2(name):
    dims = validate(parse_args(["--job.config_file", str(CONFIGS / name)]), 2).dims
    assert (dims.dp_shard, dims.dp_replicate, dims.tp, dims.world_size) == (2, 1, 1, 2)
    proc = config_cli("--world-size", "2", "--job.config_file", str(CONFIGS / name))
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


def test_8b_config_validates_at_world_size_8_with_tokenizer(tmp_path):
    path = str(CONFIGS / "llama3_8b.toml")
    cfg = parse_args(["--job.config_file", path])
    if not os.path.isfile(os.path.join(cfg.model.hf_assets_path, "tokenizer.json")):
        with pytest.raises(ConfigError, match=r"^model\.hf_assets_path: no tokenizer\.json"):
            validate(cfg, 8)
    make_hf_folder(tmp_path)  # validate reads it as the ranks will (its vocabulary within the model's)
    dims = validate(parse_args(["--job.config_file", path, "--model.hf_assets_path", str(tmp_path)]), 8).dims
    assert (dims.dp_shard, dims.tp, dims.pp, dims.world_size) == (8, 1, 1, 8)


# Parallelisms each big config needs beyond FSDP: it must validate at its world size with exactly the degrees its
# TOML sets.
BIG = {
    "llama3_70b.toml": (256, ("parallelism.tensor_parallel_degree",)),
    "llama3_405b.toml": (512, ("parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree")),
    "qwen3_0.6b.toml": (8, ()),
    "qwen3_8b.toml": (8, ()),
    "qwen3_32b.toml": (64, ("parallelism.tensor_parallel_degree",)),
    "qwen3_30b_a3b.toml": (8, ()),
    "qwen3_235b_a22b.toml": (128, ("parallelism.pipeline_parallel_degree", "parallelism.expert_parallel_degree")),
    "deepseek_v3_16b.toml": (8, ("parallelism.expert_parallel_degree",)),
    "deepseek_v3_671b.toml": (512, ("parallelism.expert_parallel_degree",)),
    "deepseek_v32_671b_128k.toml": (512, ("parallelism.context_parallel_degree",
                                          "parallelism.expert_parallel_degree")),
    "glm5_128k.toml": (512, ("parallelism.context_parallel_degree", "parallelism.expert_parallel_degree")),
    "gpt_oss_20b.toml": (8, ("parallelism.expert_parallel_degree",)),
    "gpt_oss_120b.toml": (64, ("parallelism.expert_parallel_degree",)),
    "llama4_scout.toml": (64, ("parallelism.expert_parallel_degree",)),
    "llama4_maverick.toml": (256, ("parallelism.pipeline_parallel_degree", "parallelism.expert_parallel_degree")),
    "qwen3_5_9b.toml": (8, ()),
    "qwen3_5_35b_a3b.toml": (16, ("parallelism.pipeline_parallel_degree",)),
    "kimi_k2.toml": (512, ("parallelism.tensor_parallel_degree", "parallelism.expert_parallel_degree")),
    "qwen3_next_80b_a3b.toml": (32, ("parallelism.pipeline_parallel_degree", "parallelism.expert_parallel_degree")),
    "kimi_linear_48b_a3b.toml": (16, ("parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                                      "parallelism.expert_parallel_degree")),
    "deepseek_v4_flash.toml": (128, ("parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                                     "parallelism.expert_parallel_degree")),
    "deepseek_v4_flash_128k.toml": (256, ("parallelism.tensor_parallel_degree", "parallelism.context_parallel_degree",
                                          "parallelism.expert_parallel_degree")),
    "deepseek_v4_pro.toml": (1024, ("parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                                    "parallelism.expert_parallel_degree")),
}


@pytest.mark.parametrize("name", BIG)
def test_big_configs_at_their_world_size(tmp_path, name):
    world, needs = BIG[name]
    make_hf_folder(tmp_path)
    cfg = parse_args(["--job.config_file", str(CONFIGS / name), "--model.hf_assets_path", str(tmp_path)])
    p = cfg.parallelism
    dims = validate(cfg, world).dims
    assert all(get(cfg, key) > 1 for key in needs)
    assert (dims.dp_shard, dims.tp, dims.pp, dims.ep, dims.world_size) == (p.data_parallel_shard_degree,
                                                                          p.tensor_parallel_degree,
                                                                          p.pipeline_parallel_degree,
                                                                          p.expert_parallel_degree, world)


def test_an_older_config_loads_with_one_line_per_moved_or_removed_option(tmp_path, caplog):
    """Options a family took over are read where they are now, an option that is gone is ignored: one warning
    line each, naming the old key and the new one (a checkpoint's saved config.toml loads the same way)."""
    import logging

    old = tmp_path / "old.toml"
    old.write_text('[model]\nname = "deepseek_v3"\n\n[training]\nmtp_loss_weight = 0.1\n\n[parallelism]\n'
                   'context_parallel_rotate_method = "allgather"\n')
    with caplog.at_level(logging.WARNING, logger="tessera"):
        cfg = parse_args(["--job.config_file", str(old)])
    assert cfg.deepseek_v3.mtp_loss_weight == 0.1
    assert [r.getMessage() for r in caplog.records if r.name == "tessera"] == [
        f"training.mtp_loss_weight (in {old}) has moved to deepseek_v3.mtp_loss_weight; read as that (rename it)",
        f"parallelism.context_parallel_rotate_method (in {old}) is ignored: context parallelism rotates nothing "
        f"around a ring (see parallelism.context_parallel_method); remove the key"]
    cfg = parse_args(["--training.mtp_loss_weight", "0.2", "--parallelism.context_parallel_rotate_method",
                      "allgather", "--training.steps", "3"])
    assert (cfg.deepseek_v3.mtp_loss_weight, cfg.training.steps) == (0.2, 3)
    saved = tomllib.loads(to_toml(cfg))
    assert saved["deepseek_v3"]["mtp_loss_weight"] == 0.2 and "mtp_loss_weight" not in saved["training"]
    with pytest.raises(ConfigError, match=r"^--training.mtp_loss_weight is given twice on the command line"):
        parse_args(["--deepseek_v3.mtp_loss_weight", "0.1", "--training.mtp_loss_weight", "0.2"])


def test_each_familys_options_are_its_own_section_in_help_and_in_the_saved_config():
    text = help_text()
    assert "[flux]" in text and "[deepseek_v3]" in text and "  --deepseek_v3.mtp_loss_weight" in text
    assert "--training.mtp_loss_weight" not in text and "context_parallel_rotate_method" not in text
    saved = tomllib.loads(to_toml(parse_args(["--model.name", "flux"])))
    assert saved["flux"]["resolution"] == 16 and saved["deepseek_v3"]["mtp_loss_weight"] == 0.3
    with pytest.raises(ConfigError, match=r"^model.name \(on the command line\): 'nope' is not one of llama3, "):
        parse_args(["--model.name", "nope"])


@pytest.mark.fast
def test_a_familys_config_type_names_the_section_the_schema_mounts():
    """Family code hints `cfg` with a type that has its section (`cfg.deepseek_v3`, `cfg.flux`): the very class
    the one schema mounts under that name, on the shared JobConfig."""
    from tessera.config import JobConfig as Shared
    from tessera.models.deepseek.v3.options import DeepSeekV3Config
    from tessera.models.flux.options import FluxConfig
    from tessera.schema import schema

    fields = schema().__dataclass_fields__
    for view, section in ((DeepSeekV3Config, "deepseek_v3"), (FluxConfig, "flux")):
        assert view.__annotations__ == {section: fields[section].type}
        assert view.__bases__ == (Shared,) and issubclass(schema(), Shared)


@pytest.mark.fast
def test_another_familys_section_is_refused_on_the_command_line_and_named_from_a_shared_toml(tmp_path, capsys,
                                                                                                caplog):
    """A Llama 3 run reads no [deepseek_v3] section: a flag of it (even at its default, even by its old name) is
    refused before launch in one line; a TOML shared across families keeps its sections, named in one warning
    line. The family's own section is read as ever."""
    from tessera import config_cli
    from tessera.schema import parse_run

    base = ["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run")]
    assert config_cli.main([*base, "--deepseek_v3.mtp_loss_weight", "0.3"]) == 2
    assert capsys.readouterr().err == ("tessera: deepseek_v3.mtp_loss_weight (on the command line): model.name is "
                                       "'llama3', whose runs read no [deepseek_v3] section; drop the flag, or set "
                                       "model.name\n")
    assert config_cli.main([*base, "--flux.sample_freq=5"]) == 2 and "flux.sample_freq" in capsys.readouterr().err
    assert config_cli.main([*base, "--training.mtp_loss_weight", "0"]) == 2  # moved there: the same section's
    assert "tessera: deepseek_v3.mtp_loss_weight (on the command line)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    shared = tmp_path / "shared.toml"
    shared.write_text('[model]\nname = "llama3"\nflavor = "tiny"\n\n[deepseek_v3]\nmtp_loss_weight = 0.1\n\n'
                      '[flux]\nsample_freq = 5\n')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tessera"):
        cfg = parse_run(["--job.config_file", str(shared)])
    assert cfg.model.name == "llama3"
    assert [r.getMessage() for r in caplog.records] == [
        f"deepseek_v3.mtp_loss_weight, flux.sample_freq (in {shared}): ignored, model.name is 'llama3'"]
    own = parse_run(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--deepseek_v3.mtp_loss_weight",
                     "0.1"])
    assert own.deepseek_v3.mtp_loss_weight == 0.1
