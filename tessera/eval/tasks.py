"""The tasks `eval.tasks` names, checked before anything runs: lm-eval task names (an unknown one gets the nearest
names), or task YAML files, read as lm-eval reads them and handed over as task configs, their local `data_files`
taken relative to the YAML's folder (so a task set can ship with its data); a task that needs the Hugging Face hub
while this machine is offline, a data file that is not there, or more shots than its examples can give are refused
in one line. `table` writes lm-eval's results as its own table does, column names included."""

import csv
import difflib
import glob
import json
import os
from pathlib import Path

from tessera.config import ConfigError
from tessera.data import json_array

# datasets' builders that read local files (`dataset_path: json` with `data_files`), not the hub
_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}


def resolve(names: list[str], num_fewshot: int = 0) -> list:
    """What lm_eval.simple_evaluate takes as `tasks`: names as they are, each YAML as its config dict.
    `num_fewshot`: eval.num_fewshot (0: each task's own)."""
    tasks, plain = [], []
    for name in names:
        if name.endswith((".yaml", ".yml")):
            tasks.append(_from_yaml(Path(name), num_fewshot))
        else:
            plain.append(name)
            tasks.append(name)
    if plain:
        from lm_eval.tasks import TaskManager

        known = set(TaskManager().all_tasks)
        for name in plain:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
                raise ConfigError(f"eval.tasks: no lm-eval task '{name}'" +
                                  (f"; the nearest: {', '.join(near)}" if near else "; `lm_eval ls tasks` lists them")
                                  + ", or give a task YAML's path")
    return tasks


def _from_yaml(path: Path, num_fewshot: int) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    if not path.is_file():
        raise ConfigError(f"eval.tasks: {path} not found")
    try:
        config = load_yaml(path, resolve_func=True)
    except Exception as e:  # yaml's and lm-eval's errors alike: say which file
        raise ConfigError(f"eval.tasks: {path} is not a task YAML lm-eval reads ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from None
    if not isinstance(config, dict) or "task" not in config:
        raise ConfigError(f"eval.tasks: {path} names no `task`; a task YAML of lm-eval is required")
    kwargs = dict(config.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is not None:  # relative to the YAML, not to wherever the run was started
        at = lambda f: str(path.parent / f) if not os.path.isabs(f) else f  # noqa: E731
        kwargs["data_files"] = files = _split_files(files, at)
        config = {**config, "dataset_kwargs": kwargs}
    source = config.get("dataset_path", "")
    if files is not None and source in _LOCAL_BUILDERS:  # before a run trains, not at its first evaluation
        for file in (f for split in files.values() for f in split if "://" not in f):
            if not (glob.glob(file) if glob.has_magic(file) else os.path.isfile(file)):
                raise ConfigError(f"eval.tasks: {path} reads {file} (dataset_kwargs.data_files, taken from the YAML's "
                                  f"folder), which does not exist; fix the path in the YAML, or put the file there")
        _check_shots(path, config, files, num_fewshot)
    if source not in _LOCAL_BUILDERS and not Path(source).exists() and _offline():
        raise ConfigError(f"eval.tasks: {path}'s task {config['task']} reads dataset_path '{source}' from the "
                          f"Hugging Face hub, and this machine is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); "
                          f"point it at local files (dataset_path: json, dataset_kwargs.data_files)")
    return config


def _split_files(files, at) -> dict[str, list[str]]:
    """datasets' `data_files` as {split: [file]}, each file through `at` (a name or a list: the train split)."""
    if not isinstance(files, dict):
        files = {"train": files}
    return {split: [at(f) for f in ([names] if isinstance(names, str) else names)] for split, names in files.items()}


def _check_shots(path: Path, config: dict, files: dict[str, list[str]], num_fewshot: int) -> None:
    """The shots of a task over local files: lm-eval draws them from its few-shot split (else training, validation,
    test: the first it has), leaving the question out when that is its test split."""
    shots = num_fewshot or config.get("num_fewshot") or 0
    fewshot = config.get("fewshot_config") or {}
    named = fewshot.get("split") or config.get("fewshot_split")
    if not shots or (named is None and fewshot.get("samples") is not None):
        return
    split = named or next((config[k] for k in ("training_split", "validation_split", "test_split") if config.get(k)),
                          None)
    try:
        counts = [_examples(f, config.get("dataset_path"), config["dataset_kwargs"]) for f in files.get(split, [None])]
    except (OSError, ValueError, KeyError, TypeError):  # a file datasets will not read either: it says why
        return
    if None in counts or shots <= (most := sum(counts) - (named is not None and named == config.get("test_split"))):
        return
    what = f"eval.num_fewshot: {shots}" if num_fewshot else f"eval.tasks: {path}'s num_fewshot {shots}"
    other = " other than the question" if most < sum(counts) else ""
    raise ConfigError(f"{what}, but task {config['task']} ({path}) draws its shots from the {sum(counts)} examples "
                      f"of its {split} split{other}; at most {most}, or give the task more examples (a fewshot_split)")


def _examples(file: str | None, builder: str, kwargs: dict) -> int | None:
    """How many examples datasets' `builder` reads from `file` (None where not known without it: a pattern, an
    Arrow file)."""
    if file is None or glob.has_magic(file) or builder not in ("json", "csv", "text", "parquet"):
        return None
    if builder == "parquet":
        import pyarrow.parquet as pq  # deferred: pyarrow is only needed for parquet files

        return pq.read_metadata(file).num_rows
    with open(file, "rb") as fh:
        if builder == "json" and (kwargs.get("field") or json_array.is_array(fh)):
            data = json.loads(fh.read().removeprefix(json_array.BOM))
            return len(data[kwargs["field"]] if kwargs.get("field") else data)
        lines = fh.read().removeprefix(json_array.BOM).decode("utf-8", errors="replace").splitlines()
    if builder == "csv":
        return max(len(list(csv.reader(lines))) - 1, 0)  # the header
    return len(lines) if builder == "text" else sum(1 for line in lines if line.strip())


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def task_manager(names: list[str]):
    """lm-eval's TaskManager for `names`: indexing its 14,000 built-in tasks takes 6 s, so only when a name (not a
    YAML) asks for one."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=any(not n.endswith((".yaml", ".yml")) for n in names))


def evaluate(lm, cfg, manager=None) -> dict:
    """lm-eval's results of the [eval] tasks on `lm` (a TesseraLM); `manager`: task_manager's, made once."""
    from lm_eval import simple_evaluate

    e = cfg.eval
    out = simple_evaluate(model=lm, tasks=resolve(e.tasks, e.num_fewshot), task_manager=manager or task_manager(
                              e.tasks), num_fewshot=e.num_fewshot or None, limit=e.limit or None, log_samples=False,
                          bootstrap_iters=0, random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    return out or {}


def scores(results: dict) -> dict[str, float]:
    """{task/metric: value} of lm-eval's results: its metrics (`acc,none`: a metric after a filter; the filter
    `none` dropped), not their stderr or the sample counts."""
    return {f"{task}/{metric.removesuffix(',none')}": float(value)
            for task, metrics in results.get("results", {}).items() for metric, value in metrics.items()
            if "," in metric and isinstance(value, (int, float)) and "_stderr" not in metric}


def table(results: dict) -> str:
    """lm-eval's results as the Markdown table its make_table prints: a row per task and metric, with its version,
    filter, shots, value and standard error. (lm-eval's own prints its column names as A, B, C, ...: it sets the
    `headers` newer pytablewriters read, and this environment resolves to 0.38, which reads `header_list`; the
    newer ones need a python-dateutil below the 4.0 installed here.)"""
    head = ["Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr"]
    rows = []
    for task, metrics in results.get("results", {}).items():
        better = results.get("higher_is_better", {}).get(task, {})
        name, version = metrics.get("alias", task), str(results.get("versions", {}).get(task, "N/A"))
        for key in sorted(k for k in metrics if "," in k and "_stderr," not in k):
            metric, _, kind = key.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{kind}")
            rows.append([name, version, kind, str(results.get("n-shot", {}).get(task, "")), metric,
                         {True: "↑", False: "↓"}.get(better.get(metric), ""), _cell(metrics[key]),
                         "±" if stderr is not None else "", _cell(stderr) if stderr is not None else ""])
            name = version = ""  # the task's name and version on its first row only
    widths = [max(3, *(len(r[i]) for r in [head, *rows])) for i in range(len(head))]
    line = lambda cells: "|" + "|".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + "|"  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def _cell(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
