"""See what a model learned: sample a continuation of a prompt, with a KV cache, in one process.

    python -m tessera.generate --job.dump_folder ./outputs/llama3_debug --generate.prompt "def main("
    python -m tessera.generate --checkpoint.initial_load_in_hf --checkpoint.initial_load_path HF_DIR \\
        --generate.prompt "Once upon a time" --generate.temperature 0 --generate.json

The model is the newest checkpoint under `job.dump_folder` (full or weights-only, in whatever layout it was
saved), or `checkpoint.initial_load_path`: a Tessera checkpoint folder, or with `initial_load_in_hf` a
Hugging Face folder. Its architecture is what the checkpoint records (or config.json); the tokenizer is
`model.hf_assets_path`, else the checkpoint's, else the HF folder's own tokenizer.json, else bytes.

A family that samples its own way (ModelSpec.draw: Flux's images of a caption) draws 4 samples (noise seeds
generate.seed .. +3) of the loaded model, written as one grid to <dump_folder>/samples/generate-<seed>.png, whose
path is printed. Its options (Flux's encoders, resolution and sampling settings) are the checkpoint's run's (its
config.toml), or for a Hugging Face folder those the folder implies (Flux: the release it is part of), overridable
with flags (--flux.*).
"""

import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Collection
from pathlib import Path

import torch

from tessera import models
from tessera.checkpoint.folder import read_model_record, read_saved_config
from tessera.checkpoint.hf import HFError
from tessera.config import ConfigError
from tessera.images import grid, save_png
from tessera.pretrained import DEFAULT_MAX_SEQ_LEN, checkpoint_folder, from_pretrained, hf_family, is_hf, pick_device
from tessera.schema import help_text, parse_args

__all__ = ["DEFAULT_MAX_SEQ_LEN", "from_pretrained", "generate", "hf_family", "is_hf", "main"]

log = logging.getLogger("tessera")
N_IMAGES = 4  # what a family that draws (ModelSpec.draw) samples of a prompt


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """One token from the last position's logits [vocab]: greedy at temperature 0, else from the softmax at
    `temperature` over the `top_k` most likely (0: all) and their smallest set holding `top_p` of the mass."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k:
        logits[logits < logits.topk(min(top_k, logits.numel())).values[-1]] = -float("inf")
    if top_p < 1:
        probs, order = logits.softmax(-1).sort(descending=True)
        beyond = probs.cumsum(-1) - probs > top_p  # tokens after the mass reached top_p
        logits[order[beyond]] = -float("inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen))


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | Collection[int] | None = None, seed: int = 0,
             use_cache: bool = True) -> list[int]:
    """The new token ids after `prompt_ids` (stopping after `eos_id`, or any of several). Without the cache every
    step recomputes the whole sequence: the reference the cached path is tested against."""
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    weight = next(model.parameters())
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], device=weight.device)
    cache = model.new_cache(1, len(prompt_ids) + max_new_tokens, weight.dtype, weight.device) if use_cache else None
    logits = model(ids, cache)[0, -1]
    out = []
    for _ in range(max_new_tokens):
        token = _sample(logits, temperature, top_k, top_p, gen)
        out.append(token)
        if token in stop or len(out) == max_new_tokens:
            break
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
        logits = model(ids[:, -1:], cache)[0, -1] if use_cache else model(ids)[0, -1]
    return out


def _prompt(g, tokenizer) -> list[int]:
    if g.prompt_ids:
        try:
            return [int(i) for i in g.prompt_ids]
        except ValueError:
            raise ConfigError(f"generate.prompt_ids: {','.join(g.prompt_ids)} are not all integers") from None
    return [tokenizer.bos_id, *tokenizer.encode(g.prompt)]


def _stop_ids(source: str, hf: bool, tokenizer) -> set[int]:
    """What ends a sample: a Hugging Face folder's own eos_token_id (an id or a list; generation_config.json, else
    config.json), as transformers' generate() stops; else the tokenizer's EOS."""
    if is_hf(source, hf or None):
        for name in ("generation_config.json", "config.json"):
            try:
                eos = json.loads((Path(source) / name).read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                continue
            if eos is not None:
                return {eos} if isinstance(eos, int) else set(eos)
    return {tokenizer.eos_id}


def _drawing_family(source: str, hf: bool):
    """The family of a Tessera checkpoint or a Hugging Face folder when it draws its samples its own way
    (ModelSpec.draw: Flux's images), else None."""
    try:
        if is_hf(source, hf or None):
            fam = hf_family(source)
        else:
            record = read_model_record(checkpoint_folder(source))
            fam = models.family(record["family"]) if record else None
    except (ConfigError, HFError):  # nothing a model loads from: from_pretrained says why
        return None
    return fam if fam is not None and fam.spec().draw is not None else None


def _with_run_options(cfg, fam, folder: str, hf: bool, argv: list[str]):
    """cfg with the family's options of the checkpoint's run (its config.toml; a Hugging Face folder: those it
    implies, ModelSpec.draw_options), except what the command line sets."""
    saved = read_saved_config(folder).get(fam.name, {})
    if hf and fam.spec().draw_options is not None:
        saved = fam.spec().draw_options(folder) or saved
    given = {a[2:].partition("=")[0].split(".", 1)[1] for a in argv if a.startswith(f"--{fam.name}.")}
    section = getattr(cfg, fam.name)
    fields = {f.name for f in dataclasses.fields(section)}
    options = dataclasses.replace(section, **{k: v for k, v in saved.items() if k in fields and k not in given})
    return dataclasses.replace(cfg, **{fam.name: options})


def _draw(cfg, fam, argv: list[str]) -> int:
    """N_IMAGES samples of generate.prompt (noise seeds generate.seed ...) by the family's own sampler, as one grid
    in <dump_folder>/samples/generate-<seed>.png; prints its path."""
    g = cfg.generate
    source = cfg.checkpoint.initial_load_path or cfg.job.dump_folder
    hf = is_hf(source, cfg.checkpoint.initial_load_in_hf or None)
    folder = source if hf else checkpoint_folder(source)
    model, _ = from_pretrained(folder, pick_device(g.device), hf=hf)
    if not g.prompt:
        raise ConfigError("generate.prompt: empty; give the caption to draw")
    cfg = _with_run_options(cfg, fam, folder, hf, argv)
    try:
        images = fam.spec().draw(model, cfg, folder, g.prompt, [g.seed + i for i in range(N_IMAGES)])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    path = os.path.join(cfg.job.dump_folder, "samples", f"generate-{g.seed}.png")
    save_png(grid(images, cols=N_IMAGES), path)
    print(path)
    return 0


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        options = help_text().partition("\n\n")[2]  # less the training command's usage line
        print(f"{__doc__.strip()}\n\nOptions: [generate], and [model] and [checkpoint] for what to load.\n\n{options}")
        return 0
    try:
        cfg = parse_args(argv)
        g, c = cfg.generate, cfg.checkpoint
        source = c.initial_load_path or cfg.job.dump_folder
        if (fam := _drawing_family(source, c.initial_load_in_hf)) is not None:
            return _draw(cfg, fam, argv)
        # Its output is stdout: what loading logs goes to stderr, also where a run earlier in this process set up
        # the tessera logger on stdout.
        with contextlib.redirect_stdout(sys.stderr):
            model, tokenizer = from_pretrained(source, pick_device(g.device), hf=c.initial_load_in_hf or None,
                                               max_seq_len=None, hf_assets_path=cfg.model.hf_assets_path)
        prompt = _prompt(g, tokenizer)
        if max(prompt) >= model.args.vocab_size:
            raise ConfigError(f"generate.prompt_ids: id {max(prompt)} is past the model's vocabulary "
                              f"({model.args.vocab_size})")
        device = next(model.parameters()).device  # the RoPE table for every position asked, however many
        model.init_buffers(device, torch.arange(len(prompt) + g.max_new_tokens, device=device))
        stop = set() if g.ignore_eos else _stop_ids(source, c.initial_load_in_hf, tokenizer)
        out = generate(model, prompt, g.max_new_tokens, g.temperature, g.top_k, g.top_p, stop, g.seed)
    except (ConfigError, HFError) as e:
        print(f"tessera.generate: {e}", file=sys.stderr)
        return 2
    text = tokenizer.decode(out)
    print(json.dumps({"prompt_ids": prompt, "output_ids": out, "text": text}) if g.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
