"""Downstream evaluation (tessera/eval, [eval]): Tessera's lm-eval model against lm-eval's `hf` backend on the same
Hugging Face folder (multiple choice, rolling log-likelihood, generation: task YAMLs over local JSON in
tests/eval_tasks), the command lines, lm-eval's own `hf` model on exports, and bad input refused in one line."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "eval_tasks"
YAMLS = [str(TASKS / f"{name}.yaml") for name in ("mc", "rolling", "gen")]


def bpe_folder(folder: Path, family: str = "llama") -> Path:
    """A tiny Llama (or Qwen 3, `family` "qwen3": per-head q/k norms) saved by transformers, with a byte-level BPE
    trained on the tasks' texts whose post-processor puts BOS first (as Llama 3's): lm-eval's hf backend encodes
    with it, special tokens included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    texts = [line for f in TASKS.glob("*.jsonl") for line in f.read_text().splitlines()] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    sizes = dict(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=96, bos_token_id=0, eos_token_id=1,
                 tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**sizes)) if family == "llama" else \
        Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=8))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # sharp enough that greedy picks are clear and choices differ
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return bpe_folder(tmp_path_factory.mktemp("bpe_llama"))


def _samples(results: dict) -> dict:
    return {task: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
            for task, rows in results["samples"].items()}


def test_loglikelihoods_and_generations_equal_lm_evals_hf_backend(folder):
    """Each request's log-likelihood within 1e-4 and its greedy flag, the rolling log-likelihoods, the generated
    texts, and so every task's scores: Tessera's model (loaded from the folder) against lm-eval's hf backend."""
    from lm_eval import simple_evaluate

    from tessera.eval.lm import TesseraLM
    from tessera.eval.tasks import resolve

    ours_lm = TesseraLM(checkpoint=str(folder), hf=True, batch_size=4, device="cpu", max_gen_toks=16)
    runs = [simple_evaluate(model=lm, model_args=args, tasks=resolve(YAMLS), log_samples=True, bootstrap_iters=0)
            for lm, args in (("hf", {"pretrained": str(folder), "dtype": "float32", "device": "cpu",
                                     "batch_size": 4}), (ours_lm, None))]
    theirs, ours = (_samples(r) for r in runs)
    assert theirs.keys() == ours.keys() == {"tessera_test_mc", "tessera_test_rolling", "tessera_test_gen"}
    for task in theirs:
        for want, got in zip(theirs[task], ours[task], strict=True):
            if task == "tessera_test_mc":  # [[(logprob, greedy)], ...] per choice
                for (w,), (g,) in zip(want, got, strict=True):
                    assert g[0] == pytest.approx(w[0], abs=1e-4) and g[1] == w[1], (task, want, got)
            elif task == "tessera_test_rolling":
                assert got[0] == pytest.approx(want[0], abs=1e-4), (task, want, got)
            else:
                assert got == want, (task, want, got)
    generated = [r[0][0] for r in ours["tessera_test_gen"]]
    assert any(generated), generated  # not all empty: the comparison above compared text
    for task, metrics in runs[0]["results"].items():
        for metric, value in metrics.items():
            if isinstance(value, float) and "stderr" not in metric:
                assert runs[1]["results"][task][metric] == pytest.approx(value, rel=1e-4), (task, metric)


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_lm_evals_command_line_with_the_tessera_model_scores_as_tessera_eval(folder, tmp_path, capsys):
    """lm-eval's own command line, with the `tessera` model registered (python -m tessera.eval.harness), on the
    folder: the scores `python -m tessera.eval` prints as JSON."""
    from tessera.eval.__main__ import main

    assert main(["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder), "--eval.tasks",
                 YAMLS[0], "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert set(scores) == {"tessera_test_mc/acc", "tessera_test_mc/acc_norm"}
    harness = _cli("tessera.eval.harness", "--model", "tessera", "--model_args", f"checkpoint={folder},hf=true",
                   "--tasks", "tessera_test_mc", "--include_path", str(TASKS), "--output_path", str(tmp_path),
                   "--device", "cpu", cwd=TASKS)
    assert harness.returncode == 0, harness.stderr[-3000:]
    written = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert written["results"]["tessera_test_mc"]["acc,none"] == scores["tessera_test_mc/acc"]
    # Without --json, lm-eval's table with its column names (not the A, B, C of pytablewriter 0.38)
    assert main(["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder), "--eval.tasks",
                 YAMLS[0]]) == 0
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr"]
    assert [row[4:7] for row in rows[2:]] == [["acc", "↑", f"{scores['tessera_test_mc/acc']:.4f}"],
                                              ["acc_norm", "↑", f"{scores['tessera_test_mc/acc_norm']:.4f}"]]


@pytest.mark.parametrize("tasks, expect", [
    ("hellasawg", "eval.tasks: no lm-eval task 'hellasawg'; the nearest: hellaswag"),  # 6 s: lm-eval's index
    ("missing.yaml", "eval.tasks: missing.yaml not found"),
])
def test_unknown_tasks_are_refused_with_the_nearest_names(tasks, expect):
    from tessera.eval.tasks import resolve

    with pytest.raises(ConfigError, match=expect):
        resolve([tasks])


def _task_copy(folder: Path, name: str, change: tuple[str, str] = ("", "")) -> str:
    """tests/eval_tasks/<name>.yaml and its data in `folder`, the YAML's text changed as `change` says."""
    for suffix in (".yaml", ".jsonl"):
        text = (TASKS / f"{name}{suffix}").read_text()
        (folder / f"{name}{suffix}").write_text(text.replace(*change) if suffix == ".yaml" else text)
    return str(folder / f"{name}.yaml")


BAD_TASKS = {  # name: (the task, [eval] flags, the line: {} the task's YAML, {dir} its folder)
    "missing_data_file": (("mc", ("test: mc.jsonl", "test: mc_questions.jsonl")), [],
                          "eval.tasks: {} reads {dir}/mc_questions.jsonl (dataset_kwargs.data_files, taken from the "
                          "YAML's folder), which does not exist; fix the path in the YAML, or put the file there"),
    "num_fewshot": (("gen", ("", "")), ["--eval.num_fewshot", "4"],
                    "eval.num_fewshot: 4, but task tessera_test_gen ({}) draws its shots from the 3 examples of its "
                    "test split; at most 3, or give the task more examples (a fewshot_split)"),
    "its_own_num_fewshot": (("mc", ("test_split: test", "test_split: test\nfewshot_split: test\nnum_fewshot: 6")),
                            [], "eval.tasks: {}'s num_fewshot 6, but task tessera_test_mc ({}) draws its shots from "
                                "the 6 examples of its test split other than the question; at most 5, or give the "
                                "task more examples (a fewshot_split)"),
}


@pytest.mark.parametrize("case", BAD_TASKS)
def test_a_task_that_would_fail_at_its_first_evaluation_is_refused_before_the_run(case, tmp_path, capsys):
    """A data file a task YAML names that is not there, and more shots than a task's examples give (lm-eval's
    "Sample larger than population"): one line, exit 2, from the launch check before any rank trains, and from
    python -m tessera.eval before the model loads. The most shots a task gives run."""
    from tessera.config_cli import main as check
    from tessera.eval.__main__ import main as evaluate

    (name, change), flags, line = BAD_TASKS[case]
    task = _task_copy(tmp_path, name, change)
    expect = line.format(task, task, dir=tmp_path)
    assert check(["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run"), "--eval.tasks", task,
                  *flags]) == 2
    assert capsys.readouterr().err == f"tessera: {expect}\n"
    assert evaluate(["--checkpoint.initial_load_path", str(tmp_path / "none"), "--eval.tasks", task, *flags]) == 2
    assert capsys.readouterr().err == f"tessera.eval: {expect}\n"
    assert not (tmp_path / "run").exists()
    if flags:
        from tessera.eval.tasks import resolve

        assert resolve([task], 3)[0]["task"] == "tessera_test_gen"


def test_a_hub_task_while_offline_is_refused_in_one_line(tmp_path, monkeypatch):
    from tessera.eval.tasks import resolve

    hub = tmp_path / "hub.yaml"
    hub.write_text((TASKS / "mc.yaml").read_text().replace("dataset_path: json", "dataset_path: allenai/ai2_arc"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError, match="reads dataset_path 'allenai/ai2_arc' from the Hugging Face hub, and this "
                                          "machine is offline"):
        resolve([str(hub)])


EVAL = ["--eval.tasks", f"{YAMLS[0]},{YAMLS[2]}", "--eval.interval", "2", "--eval.max_gen_toks", "4"]


def _eval_rows(dump: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k.removeprefix("eval/"): v for k, v in r.items() if k.startswith("eval/")}
            for r in rows if any(k.startswith("eval/") for k in r)}


def test_in_loop_scores_equal_tessera_eval_on_the_saved_checkpoint_and_change_nothing(tmp_path, capsys):
    """The tiny model trained 4 steps with the multiple-choice and generation tasks every 2 steps: its scores in
    metrics.jsonl at steps 2 and 4 (and the seconds they took), those of step 4 equal to `python -m tessera.eval`
    on the checkpoint it saved; the run's losses equal those of the same run without evaluation; its report has a
    panel per task."""
    from tessera.eval.__main__ import main
    from tessera.report import eval_tasks, read_run, write_report
    from tests.dist_worker import run_train

    saving = ["--checkpoint.enable", "--checkpoint.interval", "4"]
    plain = run_train([*saving, "--job.dump_folder", str(tmp_path / "plain")], 4)
    evaluated = run_train([*EVAL, *saving, "--job.dump_folder", str(tmp_path / "run")], 4)
    assert evaluated["losses"] == plain["losses"]
    scores = _eval_rows(tmp_path / "run")
    assert sorted(scores) == [2, 4] and all(s["seconds"] > 0 for s in scores.values())
    assert {"tessera_test_mc/acc", "tessera_test_mc/acc_norm", "tessera_test_gen/exact_match"} <= scores[4].keys()
    runs = {"run": read_run(str(tmp_path / "run"))}  # the report: a panel per task, its metrics across steps
    assert eval_tasks(runs) == {"tessera_test_mc": ["acc", "acc_norm"], "tessera_test_gen": ["exact_match"]}
    png = write_report([str(tmp_path / "run")])
    assert struct.unpack(">II", Path(png).read_bytes()[16:24]) == (1500, 1200)  # a third row of panels
    capsys.readouterr()
    assert main(["--checkpoint.initial_load_path", str(tmp_path / "run/checkpoint/step-4"), "--eval.tasks",
                 f"{YAMLS[0]},{YAMLS[2]}", "--eval.max_gen_toks", "4", "--json"]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert offline == {k: v for k, v in scores[4].items() if k != "seconds"}


@pytest.mark.ranks
def test_in_loop_scores_under_fsdp_ep_tp_cp_and_pp_equal_one_process(tmp_path):
    """FSDP 2, Qwen 3 MoE under EP 2 (experts on their ranks, tokens sent to them), TP 2 (+SP: widths padded to 2,
    generation without the cache), CP 2 (each rank two chunks of every sequence, the logits gathered) and PP 2 (rows
    through the schedule at the training's shape, the last stage's results shared): rank 0's scores equal one
    process's, each data-parallel rank answering its share of the requests with the sharded model."""
    from tests.dist_worker import run_train
    from tests.launch import run_cases

    moe = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe"]
    # name: (the model's flags, the layout's, the local batch of 8 sequences a step)
    layouts = {"fsdp": ([], [], "4"), "ep": (moe, ["--parallelism.expert_parallel_degree", "2"], "4"),
               "tp": ([], ["--parallelism.tensor_parallel_degree", "2"], "8"),
               "cp": ([], ["--parallelism.context_parallel_degree", "2"], "8"),
               "pp": ([], ["--parallelism.pipeline_parallel_degree", "2"], "8")}
    every = ["--eval.tasks", ",".join(YAMLS), *EVAL[2:]]  # the rolling task's perplexities: scores not counts
    run_cases(2, [[*every, *model, *layout, "--training.local_batch_size", batch, "--job.dump_folder",
                   str(tmp_path / name)] for name, (model, layout, batch) in layouts.items()], 2, mode="train")
    for model, name in ((model, "moe" if model else "dense") for model in ([], moe)):
        run_train([*every, *model, "--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path / name)], 2)
    for name, (model, _, _) in layouts.items():
        got, want = _eval_rows(tmp_path / name), _eval_rows(tmp_path / ("moe" if model else "dense"))
        assert sorted(got) == sorted(want) == [2] and len(want[2]) == 7, (name, want)
        for key, value in want[2].items():
            if key != "seconds":
                assert got[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


@pytest.mark.parametrize("argv, expect", [
    (["--job.config_file", str(ROOT / "configs/flux_debug.toml")], "eval.tasks: flux is no language model of "
                                                                   "tokens"),
    (["--model.flavor", "tiny", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree",
      "2"], "eval.tasks: in-loop evaluation runs under pipeline or context parallelism, not yet both"),
])
def test_in_loop_evaluation_is_refused_where_it_cannot_run(argv, expect):
    from tessera.preflight import validate
    from tessera.schema import parse_args

    with pytest.raises(ConfigError, match=expect):
        validate(parse_args([*argv, *EVAL]), 4, training=True)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_lm_evals_hf_model_on_an_export_scores_as_tessera_eval(family, tmp_path, monkeypatch, capsys):
    """lm-eval's stock `hf` model (lm-eval 0.4.13 takes no model plugins) on a run's Hugging Face export, offline,
    with the tokenizer the export carries (the run's model.hf_assets_path): every score `python -m tessera.eval`
    gives on the run's checkpoint of the same step, on the multiple-choice, rolling and generation tasks. The run
    starts from a tiny transformers model of the family and trains a step."""
    import datasets
    import huggingface_hub
    from lm_eval import simple_evaluate

    from tessera.eval.__main__ import main
    from tessera.eval.tasks import resolve
    from tests.launch import run_local

    hf_in = bpe_folder(tmp_path / "hf_in", "llama" if family == "llama3" else family)
    run_local(tmp_path / "run", "--model.name", family, "--model.flavor=", "--model.hf_assets_path", str(hf_in),
              "--training.steps", "1", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
              "--checkpoint.initial_load_path", str(hf_in), "--checkpoint.last_save_in_hf")
    export = tmp_path / "run/checkpoint/exports/step-1"
    assert (export / "tokenizer.json").read_bytes() == (hf_in / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["--checkpoint.initial_load_path", str(tmp_path / "run/checkpoint/step-1"), "--eval.tasks",
                 ",".join(YAMLS), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    for module in (huggingface_hub.constants, datasets.config):  # read once at import: the variable alone is late
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    theirs = simple_evaluate(model="hf", model_args={"pretrained": str(export), "dtype": "float32", "device": "cpu",
                                                     "batch_size": 4}, tasks=resolve(YAMLS), bootstrap_iters=0)
    assert {key.split("/")[0] for key in ours} == set(theirs["results"]) == \
        {"tessera_test_mc", "tessera_test_rolling", "tessera_test_gen"}
    for key, value in ours.items():
        task, metric = key.split("/")
        assert theirs["results"][task][f"{metric},none"] == pytest.approx(value, rel=1e-4), key
