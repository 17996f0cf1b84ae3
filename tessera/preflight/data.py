"""What a run reads: the data plan, the dataset and its first documents, raw files' records, chat examples."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os

from tessera.config import ConfigError
from tessera.preflight.draft import Draft
from tessera.run_plan import DataPlan

log = logging.getLogger("tessera")


def plan(d: Draft) -> None:
    """Resolves what validation finds of the data."""
    from tessera.data import tokens

    own, resume = d.family.own_data, d.resume
    d.data = DataPlan(own=own, prepared=not own and tokens.wanted(d.cfg.training),
                      resumes_position=resume is not None and resume.kind == "full"
                      and "dataloader" not in d.cfg.checkpoint.exclude_from_loading)


def attention_mask(d: Draft) -> None:
    """Resolves model.attn_mask_type = auto in draft.cfg: block_causal for chat and prompt-completion examples (each
    example its own document), causal otherwise. Causal asked for on examples runs, with a line saying what it
    means."""
    m, examples = d.cfg.model, not d.data.own and d.cfg.training.dataset_format != "text"
    if m.attn_mask_type == "auto":
        d.cfg = dataclasses.replace(d.cfg, model=dataclasses.replace(
            m, attn_mask_type="block_causal" if examples else "causal"))
    elif m.attn_mask_type == "causal" and examples:
        log.warning(f"model.attn_mask_type: causal lets each packed {d.cfg.training.dataset_format} example attend "
                    f"to the ones before it in its window; block_causal (the default for them) keeps it to itself")
    if d.resumed_config is not None:  # a change on resume is applied, and said
        saved = d.resumed_config.get("model", {}).get("attn_mask_type", "causal")
        if saved != (now := d.cfg.model.attn_mask_type):
            log.warning(f"model.attn_mask_type: the checkpoint at {d.resume.path} trained with {saved}, this run "
                        f"goes on with {now}")


def dataset(d: Draft) -> None:
    """The dataset, its first documents, and that tokenizer.json is whole: what would otherwise fail once ranks
    run. (Whether the Hub answers is asked by each rank, when it opens the stream: a config can be checked offline.)
    A family with its own data checks it in its own check."""
    if d.data.own:
        return
    from tessera.data import sources, tokens

    cfg, t = d.cfg, d.cfg.training
    sources.check_dataset(t.dataset, t.dataset_path)
    if t.dataset_mix or t.dataset == "tokenized":
        tokens.check(cfg)  # each prepared folder whole, made by this run's tokenizer, big enough
    elif t.dataset_path and not (os.path.exists(t.dataset_path) or glob.glob(t.dataset_path)):
        raise ConfigError(f"training.dataset_path: nothing matches '{t.dataset_path}'")
    elif tokens.wanted(t):
        tokens.check(cfg)
    sources.check_validation_path(cfg)
    if cfg.model.hf_assets_path:
        path = os.path.join(cfg.model.hf_assets_path, "tokenizer.json")
        try:
            with open(path, encoding="utf-8") as fh:
                json.load(fh)
        except ValueError as e:  # a download cut short, or not JSON at all
            raise ConfigError(f"model.hf_assets_path: {path} is not valid JSON ({e}); download it again") from None


def files(d: Draft) -> None:
    """Raw files (training.dataset = files, not prepared): a document to train on (and one held out, with
    validation), and a sample of their records whose rate of bad ones would not pass training.max_bad_records over
    the records this run reads (tessera/data/sample.py says how that is estimated). Chat or instruction data: its
    examples."""
    from tessera.data import sources
    from tessera.data.sample import RunReads

    cfg, t, dims = d.cfg, d.cfg.training, d.dims
    per_step = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp
    held_out = cfg.validation.enable and not cfg.validation.dataset_path  # record 100, 200, ... of the files
    reads = RunReads(train_samples=t.steps * per_step, window=t.seq_len + 1, streams=t.data_streams,
                     validation_samples=cfg.validation.steps * t.local_batch_size * dims.dp if held_out else 0)
    if t.dataset_format != "text" and not d.data.own:
        from tessera.data.examples import check_examples

        return check_examples(cfg, reads if t.dataset == "files" and not d.data.prepared else None)
    if t.dataset != "files" or d.data.prepared or d.data.own:
        return
    sources.check_files(t.dataset_path, t.dataset_text_field, held_out, t.max_bad_records, reads)
