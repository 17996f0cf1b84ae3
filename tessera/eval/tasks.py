"""The tasks `eval.tasks` names, checked before anything runs: lm-eval task names (an unknown one gets the nearest
names), or task YAML files, read as lm-eval reads them and handed over as task configs, their local `data_files`
taken relative to the YAML's folder (so a task set can ship with its data); a task that needs the Hugging Face hub
while this machine is offline is refused in one line."""

import difflib
import os
from pathlib import Path

from tessera.config import ConfigError

# datasets' builders that read local files (`dataset_path: json` with `data_files`), not the hub
_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}


def resolve(names: list[str]) -> list:
    """What lm_eval.simple_evaluate takes as `tasks`: names as they are, each YAML as its config dict."""
    tasks, plain = [], []
    for name in names:
        if name.endswith((".yaml", ".yml")):
            tasks.append(_from_yaml(Path(name)))
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


def _from_yaml(path: Path) -> dict:
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
        kwargs["data_files"] = at(files) if isinstance(files, str) else \
            [at(f) for f in files] if isinstance(files, list) else {k: at(v) for k, v in files.items()}
        config = {**config, "dataset_kwargs": kwargs}
    source = config.get("dataset_path", "")
    if source not in _LOCAL_BUILDERS and not Path(source).exists() and _offline():
        raise ConfigError(f"eval.tasks: {path}'s task {config['task']} reads dataset_path '{source}' from the "
                          f"Hugging Face hub, and this machine is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); "
                          f"point it at local files (dataset_path: json, dataset_kwargs.data_files)")
    return config


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

    out = simple_evaluate(model=lm, tasks=resolve(cfg.eval.tasks), task_manager=manager or task_manager(
                              cfg.eval.tasks), num_fewshot=cfg.eval.num_fewshot or None,
                          limit=cfg.eval.limit or None, log_samples=False, bootstrap_iters=0,
                          random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    return out or {}


def scores(results: dict) -> dict[str, float]:
    """{task/metric: value} of lm-eval's results: its metrics (`acc,none`: a metric after a filter; the filter
    `none` dropped), not their stderr or the sample counts."""
    return {f"{task}/{metric.removesuffix(',none')}": float(value)
            for task, metrics in results.get("results", {}).items() for metric, value in metrics.items()
            if "," in metric and isinstance(value, (int, float)) and "_stderr" not in metric}
