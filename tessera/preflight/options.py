"""Checks of the model named, the folders a run writes, and the options of its features (fault tolerance,
checkpoints, Float8 / MX, activation checkpointing, compile, Muon, live memory)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile

from tessera import architecture
from tessera.checkpoint.space import checkpoint_bytes, room_problem
from tessera.config import ConfigError
from tessera.config.sections import (
    FLOAT8_CONVERTER as FLOAT8,
    LOADABLE_PARTS,
    MX_CONVERTER as MX,
    MX_RECIPES,
    STOP_SIGNALS,
)
from tessera.ft import check as ft_check
from tessera.preflight.draft import Draft

log = logging.getLogger("tessera")


def replica_group(d: Draft) -> None:
    """Resolves the config as this replica group runs it (fault tolerance: its own folder, the checkpoints shared;
    the config given is left as it is)."""
    d.cfg = ft_check.place_group(d.cfg)


def model(d: Draft) -> None:
    """Resolves draft.family: the one model.name names, of which model.flavor (when given) is a flavor."""
    d.family = architecture.check_model(d.cfg)


def _writable_folder(key: str, path: str) -> None:
    """`path` is a folder this process can write, or can create: refused now, not at the first save."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{key}: '{probe}' is a file, so the folder '{path}' cannot be made; pick another path")
    try:  # by creating a file: permission bits say yes to root everywhere, /proc and read-only mounts included
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".tessera-write-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: '{probe}' is not writable ({e.strerror or e}), so '{path}' cannot be written; "
                          f"pick a writable path") from None


def folders(d: Draft) -> None:
    cfg = d.cfg
    if not cfg.job.dump_folder.strip():
        raise ConfigError("job.dump_folder: empty; name the folder for this run's logs and checkpoints")
    _writable_folder("job.dump_folder", cfg.job.dump_folder)
    if cfg.checkpoint.enable:
        if not cfg.checkpoint.folder.strip():
            raise ConfigError("checkpoint.folder: empty; name a folder inside job.dump_folder, e.g. 'checkpoint'")
        folder = cfg.checkpoint.folder
        if not os.path.isabs(folder) and os.path.normpath(folder).split(os.sep)[0] == os.pardir:
            raise ConfigError(f"checkpoint.folder: '{folder}' leads out of job.dump_folder; name a folder inside it, "
                              f"or an absolute path for checkpoints kept elsewhere")
        _writable_folder("checkpoint.folder", os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder))


def initial_load_path(d: Draft) -> None:
    path = d.cfg.checkpoint.initial_load_path
    if path and not os.path.exists(path):
        raise ConfigError(f"checkpoint.initial_load_path: no such folder '{path}'")


def room(d: Draft) -> None:
    """A run that saves: the checkpoint folder has room for one more checkpoint (the newest one's size, or weights
    and two Adam moments in fp32), refused before any rank starts, not at the first save."""
    cfg = d.cfg
    if d.training and cfg.checkpoint.enable and not cfg.checkpoint.create_seed_checkpoint:
        root = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        estimate = d.family.counts(d.args, cfg.training.seq_len).params * 4 * 3
        if problem := room_problem(root, checkpoint_bytes(root, estimate)):
            raise ConfigError(f"checkpoint.folder: {problem}; free some space or pick another job.dump_folder or "
                              f"checkpoint.folder")


def tokenizer_file(d: Draft) -> None:
    assets = d.cfg.model.hf_assets_path
    if assets and not os.path.isfile(os.path.join(assets, "tokenizer.json")):
        raise ConfigError(f"model.hf_assets_path: no tokenizer.json in '{assets}'; download it with "
                          f"scripts/download_hf_assets.py or leave the path empty for the byte tokenizer")


def fault_tolerance(d: Draft) -> None:
    ft_check.check_config(d.cfg, d.args, d.data.own)


def live_groups(d: Draft) -> None:
    """At launch: the lighthouse answers and no live group runs this replica id or another config (a running
    group's rank 0 asks again, holding its id: tessera.ft)."""
    if d.launch:
        ft_check.check_live(d.cfg, d.world_size)


def has_cuda() -> bool:
    """Asked of torch (imported only for the options that need a GPU): a driver and a device it can use, not a
    tool on PATH."""
    import torch

    return torch.cuda.is_available()


def checkpoint(d: Draft) -> None:
    c = d.cfg.checkpoint
    if c.create_seed_checkpoint and (d.world_size != 1 or not c.enable):
        raise ConfigError("checkpoint.create_seed_checkpoint: run it on one process (NGPU=1) with "
                          "checkpoint.enable = true; every layout can then load its step 0")
    if c.async_mode == "async_with_pinned_mem" and not has_cuda():
        raise ConfigError("checkpoint.async_mode: async_with_pinned_mem needs a CUDA device to pin memory for; "
                          "use 'async' here")
    if c.initial_load_path and not c.enable:
        raise ConfigError("checkpoint.initial_load_path: set, but checkpoint.enable = false, so nothing would load "
                          "it; set checkpoint.enable = true")
    if c.initial_load_in_hf and not c.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf: set without checkpoint.initial_load_path; name the Hugging "
                          "Face folder to start from")
    if bad := set(c.exclude_from_loading) - set(LOADABLE_PARTS):
        raise ConfigError(f"checkpoint.exclude_from_loading: unknown part(s) {sorted(bad)}; choose from "
                          f"{', '.join(LOADABLE_PARTS)}")
    if bad := set(c.save_on_signal) - set(STOP_SIGNALS):
        raise ConfigError(f"checkpoint.save_on_signal: unknown signal(s) {sorted(bad)}; choose from "
                          f"{', '.join(STOP_SIGNALS)}, or none")


def converters(d: Draft) -> None:
    """Converters (Float8 / MX) and FSDP CPU offload. The exact GPU capability is checked at model build."""
    cfg, dims = d.cfg, d.dims
    conv, f8, mx = cfg.model.converters, cfg.quantize.linear.float8, cfg.quantize.linear.mx
    if unknown := [c for c in conv if c not in (FLOAT8, MX)]:
        raise ConfigError(f"model.converters: unknown converter(s) {unknown}; choose from {FLOAT8}, {MX}")
    if FLOAT8 in conv and MX in conv:
        raise ConfigError(f"model.converters: {FLOAT8} and {MX} would convert the same linears; pick one")
    if MX in conv and dims.tp > 1:
        raise ConfigError(f"model.converters: {MX} with tensor parallelism is not supported yet; use FSDP "
                          f"(data_parallel_shard_degree) instead, or {FLOAT8} with recipe_name = 'rowwise'")
    if FLOAT8 in conv and dims.tp > 1 and f8.recipe_name == "tensorwise":
        # Checked on gloo: step-1 gradients of TP 2 with tensorwise float8 differ from the unsharded run by ~8%
        # (rowwise: 1e-7), and torchao's float8 TP styles need float8 collectives, which gloo lacks.
        raise ConfigError(f"{FLOAT8}.recipe_name: 'tensorwise' with tensor parallelism is not supported: its "
                          f"per-tensor scales of sharded activations and gradients do not match the unsharded "
                          f"run; use recipe_name = 'rowwise' (or 'rowwise_with_gw_hp') with TP")
    for name, section in ((FLOAT8, f8), (MX, mx)):
        if name in conv and not section.emulate and not has_cuda():
            raise ConfigError(f"{name}: needs a CUDA GPU (compute capability >= {'8.9' if name == FLOAT8 else '10.0'})"
                              f" and none was found; set {name}.emulate = true to emulate it (slow; for tests) or "
                              f"remove it from model.converters")
    if FLOAT8 in conv:
        _float8(f8)
    if MX in conv and mx.recipe_name not in MX_RECIPES:
        raise ConfigError(f"{MX}.recipe_name: '{mx.recipe_name}' is not one of {', '.join(MX_RECIPES)}")
    if cfg.training.enable_cpu_offload and dims.dp == 1:
        raise ConfigError("training.enable_cpu_offload: offloads FSDP's shards, so it needs a data-parallel degree "
                          "> 1 (data_parallel_shard_degree or replicate)")


def _float8(f8) -> None:
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(f"{FLOAT8}.enable_fsdp_float8_all_gather: needs recipe_name = 'tensorwise' (one "
                          f"scale per weight), not '{f8.recipe_name}'")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not (f8.enable_fsdp_float8_all_gather
                                                            and f8.recipe_name == "tensorwise"):
        raise ConfigError(f"{FLOAT8}.precompute_float8_dynamic_scale_for_fsdp: only works with recipe_name = "
                          f"'tensorwise' and enable_fsdp_float8_all_gather = true")
    if "auto_filter_small_kn" in f8.filter_fqns and f8.recipe_name == "rowwise_with_gw_hp":
        raise ConfigError(f"{FLOAT8}.filter_fqns: auto_filter_small_kn has no size thresholds for "
                          f"rowwise_with_gw_hp; name the layers to skip instead")


def activation_checkpoint(d: Draft) -> None:
    ac = d.cfg.activation_checkpoint
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(f"activation_checkpoint.selective_ac_option: '{ac.selective_ac_option}' is neither 'op' "
                          f"nor a positive integer")


def compile(d: Draft) -> None:  # noqa: A001 (the section's name)
    c = d.cfg.compile
    if c.enable and not c.components:
        raise ConfigError("compile.components: empty while compile.enable = true; name model and/or loss, or turn "
                          "compile off")
    if c.enable and set(c.components) - {"model", "loss"}:
        raise ConfigError(f"compile.components: {c.components} may only hold 'model' and 'loss'")


def muon(d: Draft) -> None:
    cfg = d.cfg
    coefficients = cfg.optimizer.muon_ns_coefficients.split(",")
    try:
        ok = len(coefficients) == 3 and all(math.isfinite(float(c)) for c in coefficients)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"optimizer.muon_ns_coefficients: '{cfg.optimizer.muon_ns_coefficients}' is not three "
                          f"finite numbers a,b,c; e.g. 3.4445,-4.7750,2.0315")
    if cfg.optimizer.name == "Muon" and cfg.training.enable_cpu_offload:
        raise ConfigError("optimizer.name: Muon sends matrix shards between ranks' devices at each step, and "
                          "training.enable_cpu_offload keeps them in host memory; use AdamW with CPU offload")
    if cfg.optimizer.qk_clip_threshold:
        qk_clip(d)


def qk_clip(d: Draft) -> None:
    cfg, what = d.cfg, "optimizer.qk_clip_threshold"
    if cfg.optimizer.name != "Muon":
        raise ConfigError(f"{what}: QK-clip is MuonClip's (Muon's updates grow attention logits), and optimizer.name "
                          f"is {cfg.optimizer.name}; set optimizer.name = \"Muon\" or {what} = 0")
    if d.family.qk_clip is None:
        from tessera.models import FAMILIES, family

        takes = ", ".join(name for name in FAMILIES if family(name).qk_clip is not None)
        raise ConfigError(f"{what}: {cfg.model.name} says no way to scale its heads' query and key projections "
                          f"({takes} do); set it to 0")
    if d.dims.cp > 1:
        raise ConfigError(f"{what}: a head's largest logit takes each query against every key, which context "
                          f"parallelism splits over ranks; not yet under CP (set it to 0 or "
                          f"parallelism.context_parallel_degree = 1)")


def evaluation(d: Draft) -> None:
    """[eval]: tasks lm-eval knows (or task YAMLs it reads), a model of tokens, a layout the in-loop evaluation runs
    in."""
    cfg = d.cfg
    if not cfg.eval.tasks:
        return
    if d.family.spec().training is not None:
        raise ConfigError(f"eval.tasks: {cfg.model.name} is no language model of tokens; lm-eval's tasks score "
                          f"text (leave eval.tasks empty)")
    if d.training and d.dims.pp > 1 and d.dims.cp > 1:
        raise ConfigError("eval.tasks: in-loop evaluation runs under pipeline or context parallelism, not yet both "
                          "(the schedule's stages would each need the sequence's chunks); leave eval.tasks empty and "
                          "evaluate the checkpoints with python -m tessera.eval")
    from tessera.eval.tasks import resolve

    resolve(cfg.eval.tasks, cfg.eval.num_fewshot)


def lora(d: Draft) -> None:
    """[lora]: a family that takes adapters, an optimizer of low-rank updates, an alpha that scales them; resolves
    draft.cfg's lora.target_modules into the model's own names (Hugging Face's, as PEFT users write them, mapped)."""
    cfg = d.cfg
    if not cfg.lora.rank:
        return
    if not d.family.lora:
        raise ConfigError(f"lora.rank: {cfg.model.name} takes no adapters (its plan places none); set lora.rank = 0 "
                          f"to train the whole model")
    if cfg.optimizer.name == "Muon":
        raise ConfigError("optimizer.name: Muon orthogonalizes whole weight matrices, and LoRA trains low-rank "
                          "adapters beside frozen ones; use AdamW with lora.rank > 0")
    if not cfg.lora.alpha:
        raise ConfigError(f"lora.alpha: 0 scales every adapter's update by alpha / rank = 0, so the run would train "
                          f"nothing; set it above 0 (e.g. 16, or 2 x lora.rank = {2 * cfg.lora.rank})")
    if not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules: empty; name the linears to adapt, e.g. [\"wq\", \"wv\"]")
    _lora_targets(d)
    if cfg.lora.initial_adapter_path:
        saved = _peft_config(cfg.lora.initial_adapter_path)
        for ours, theirs in (("rank", "r"), ("alpha", "lora_alpha")):
            if saved.get(theirs) != getattr(cfg.lora, ours):
                raise ConfigError(f"lora.{ours}: {getattr(cfg.lora, ours)}, but the adapters of "
                                  f"lora.initial_adapter_path '{cfg.lora.initial_adapter_path}' have {theirs} = "
                                  f"{saved.get(theirs)}; set lora.{ours} = {saved.get(theirs)}")


def _lora_targets(d: Draft) -> None:
    """Resolves the targets on the model built on the meta device (torch, for LoRA runs only); at the launch,
    checks them before any rank starts."""
    import torch

    from tessera.checkpoint.peft import check_exportable, own_targets
    from tessera.lora import check_targets, targets

    with torch.device("meta"):
        model = d.family.spec().model(d.args)
    lora = d.cfg.lora
    names, mapped = own_targets(model, lora.target_modules, d.cfg.model.name)
    if mapped:
        d.cfg = dataclasses.replace(d.cfg, lora=dataclasses.replace(lora, target_modules=names))
        said = "; ".join(f"{hf} -> {', '.join(ours)} ({_linears(len(targets(model, ours)))})"
                         for hf, ours in mapped.items())
        log.info(f"lora.target_modules: Hugging Face names of {d.cfg.model.name}'s linears, taken as its own: {said}")
    if d.launch:
        check_targets(model, d.cfg.lora)
        check_exportable(model, d.cfg, d.cfg.model.name)


def _linears(n: int) -> str:
    return f"{n} linear{'s' if n != 1 else ''}"


def _peft_config(folder: str) -> dict:
    files = ("adapter_config.json", "adapter_model.safetensors")
    if not all(os.path.isfile(os.path.join(folder, f)) for f in files):
        raise ConfigError(f"lora.initial_adapter_path: no {' and '.join(files)} in '{folder}'; give a folder that "
                          f"PEFT's save_pretrained (or a Tessera LoRA export) wrote")
    with open(os.path.join(folder, files[0])) as f:
        return json.load(f)


def live_memory(d: Draft) -> None:
    if d.cfg.metrics.live_memory and d.cfg.compile.enable:
        raise ConfigError("metrics.live_memory: counts every op with a dispatch mode, which torch.compile does not "
                          "trace; measure with compile.enable = false (tessera.estimate traces compiled blocks "
                          "eagerly too)")
