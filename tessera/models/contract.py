"""The contract a model family fulfils: all that Tessera outside `tessera/models/<family>/` knows of it.

`Family` is torch-free, so configs are checked before any rank starts; its `spec()` imports the torch side,
a `ModelSpec`. A family lives in one folder whose `__init__.py` defines `FAMILY`; `tessera.models.family()`
finds it by name.
"""

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Carried:
    """Tensors a family's Hugging Face releases hold that it keeps out of its model (not trained), and that an HF
    export of a run writes back unchanged from the folder the run started from (HFAdapter.carried)."""
    prefix: str  # their names start so
    what: str  # what they are, for the line that says so
    config_keys: tuple[str, ...] = ()  # config.json's keys that describe them, copied along


class HFAdapter(Protocol):
    """Hugging Face in and out: whole state dicts (so an adapter may rename, stack, split, permute or
    dequantize) and config.json both ways. Loading reads the checkpoint into `to_hf(model_state)`, so its
    values must be the given tensors themselves or views of them (or fresh tensors that `from_hf` folds
    back, e.g. scales), for plain tensors and DTensor shards alike; `from_hf` of that is set into the model.
    Optional: `stored_names(names)`, {name in a folder: its to_hf name, or None for another model's tensor};
    `fit_to_weights(args, names, train)` -> (args, prefixes of ours the folder lacks, kept as initialized, a note
    or None): config.json's args fitted to the tensor names a folder holds (tessera.models.hf_fit);
    `weights_name`, the exported safetensors' file name stem when not "model" (diffusers': diffusion_pytorch_model);
    `to_hf_for(names)`, the to_hf that reads a folder holding `names` (after stored_names), for a model whose
    folders come in more than one layout (to_hf: the one exports write); `carried`, a Carried;
    `peft_param(stack)` -> (transformers' parameter, its position among its module's parameters, block, blocks):
    where an expert stack of ours is held, as one of `blocks` blocks of output rows; None for another name
    (tessera.checkpoint.peft: LoRA on experts in PEFT's form); `bind(args)` -> an object with the to_hf, from_hf
    and to_hf_for a model of `args` loads and exports with, for a layout that depends on the architecture (the
    unbound ones then map what they can without it)."""

    def to_hf(self, state: dict) -> dict: ...

    def from_hf(self, state: dict) -> dict: ...

    def hf_config(self, args, bos_id: int | None = None, eos_id: int | None = None) -> dict: ...

    def args_from_hf_config(self, config: dict): ...


@dataclass(frozen=True)
class Counts:
    params: int  # every parameter
    active: int  # those one token uses (below params for mixture-of-experts layers)
    embedding: int  # the input embedding: a lookup, no FLOPs (0 when it doubles as the output head)
    flops_per_token: float  # training (forward + backward) FLOPs per token at the given sequence length
    extra_act: float = 0.0  # 2-byte elements a token's forward keeps per block (mean over blocks) beyond what
    # tessera.plan.floor counts for attention and the FFN, without checkpointing (a linear-attention mixer's)


@dataclass(frozen=True)
class RunView:
    """What a family's evaluation (OwnTraining.evaluate) gets of the run, typed: not the Trainer."""
    cfg: Any
    world: Any  # tessera.distributed.World
    model: Any  # the module trained (under pipelining, a view over this rank's stages)
    loader: Any  # the training loader
    autocast: Any  # the context the model computes in
    step: int  # the optimizer steps done
    image: Callable[[str, Any, int], None]  # (tag, HWC uint8 array, step): to the run's image sinks (TensorBoard)


@dataclass(frozen=True)
class BatchView:
    """What a family's batch hook (OwnTraining.batch) gets of the run, typed: not the Trainer."""
    world: Any  # tessera.distributed.World: the device, and under context parallelism its "cp" mesh
    document_bos: int | None  # model.attn_mask_type = block_causal: a document starts at each of these tokens
    document_eos: int | None = None  # ... and ends at each of these (a BOS right after one is no target)


@dataclass(frozen=True)
class Encoded:
    """What a family's frozen encoders make of its data (ModelSpec.encode), for `python -m tessera.cache` to write
    once (tessera.data.encoded's chunks) so that training reads it instead of encoding every step."""
    folder: str  # where the cache goes (Flux: flux.latent_cache)
    splits: Mapping[str, tuple[int, Callable[[list[int]], dict]]]  # split -> (its examples, encode(example ids) ->
    # {column: tensor [len(ids), ...]})


@dataclass(frozen=True)
class OwnTraining:
    """The training-step parts a family brings in place of token windows and their cross-entropy (Flux's: with its
    own data, Family.own_data). The trainer runs its batches through `batch` and its loss through `loss`."""
    batch: Callable  # (BatchView, loader) -> (inputs by keyword, labels) on device
    loss: Callable  # (model output, labels) -> the micro-batch's mean
    data: Callable | None = None  # (cfg, world, args, splits, bad) -> {split: this rank's loader (next_batch, rewind,
    # state_dict, load_state_dict)}, built in one call so they share what is built once (Flux's frozen encoders);
    # None: the token loader
    evaluate: Callable | None = None  # (RunView, last step) -> whether it ran: the family's own evaluation after
    # each step (it decides when: Flux's sample grids every flux.sample_freq steps); every rank calls it


@dataclass(frozen=True)
class ModelSpec:
    """The torch side. `model(args)` builds on the current device (meta, for sharding first); the module has
    `init_buffers(device, positions=None)` (its position tables, at `positions`: by default 0 ... max_seq_len - 1),
    `param_init(name, full_tensor, generator)`, `forward(**inputs)` of the batch's inputs (token windows:
    `tokens` [batch, seq], and when given `documents` and `positions` [batch, seq]: each token's document number,
    which attention does not cross, and its position, e.g. in its document or, under context parallelism, in the
    whole sequence), and for decoding `forward(tokens, cache)` with `new_cache(batch, max_len, dtype, device)`."""

    model: type
    parallelize: Callable  # (model, world, cfg) -> model: the family's plan over tessera.parallel
    first_stage: tuple[str, ...]  # modules only the first pipeline stage holds
    last_stage: tuple[str, ...]  # ... only the last
    blocks: tuple[str, ...] = ("layers",)  # the block stacks pipelining splits: ModuleDicts keyed by int, in forward
    # order (a model with two stacks, Flux's double and single blocks, names both)
    training: OwnTraining | None = None  # the parts of a training step a family brings in place of token
    # windows and their cross-entropy (Flux's); None: tokens
    draw: Callable | None = None  # (model, cfg, folder, prompt, seeds) -> uint8 images [len(seeds), h, w, c], one per
    # noise seed, of the model loaded from `folder`: `python -m tessera.generate` draws a checkpoint of this family
    # so (Flux: images of a caption) and writes their grid; cfg holds the family's options of the checkpoint's run
    # where the command line leaves them. ValueError "key: why; fix"
    draw_options: Callable | None = None  # (Hugging Face folder) -> {option: value}: the family's options such a
    # folder implies for `draw`, {} when none (Flux: the encoders of the release the folder is part of)
    encode: Callable | None = None  # (cfg, args, device) -> Encoded: what its frozen encoders make of the run's data,
    # for `python -m tessera.cache`; ValueError "key: why; fix"
    begin_step: Callable | None = None  # (model or a pipeline stage's part, cfg, step from 0): what a training step
    # sets on the model before its forwards (DeepSeek V3.2's dense warm-up switch); None: nothing
    convert: Mapping[str, tuple[str, Callable]] = field(default_factory=dict)  # {mode: ("file" or "folder" it
    # writes, (src Path, dst Path) -> None)}: conversions of the family's own formats, run by `python -m
    # tessera.convert MODE SRC DST --model.name FAMILY` (Flux: Black Forest Labs' single files both ways)


@dataclass(frozen=True)
class Family:
    name: str
    flavors: Mapping[str, Any]  # flavor -> args: a dataclass with n_layers, vocab_size, max_seq_len and arch()
    takes_tokenizer_vocab: frozenset[str]  # flavors whose vocabulary is the tokenizer's
    hf: HFAdapter
    counts: Callable[[Any, int], Counts]  # (args, seq_len)
    check_layout: Callable[[Any, int, int, int, str], None]  # (args, tp, cp, pp, label): ValueError "key: why"
    embedding: str  # the input embedding's parameter (its rows are the vocabulary)
    high_precision: tuple[str, ...]  # modules float8/MX never convert: the output head
    torch_side: str  # "module:attribute" of its ModelSpec
    hf_model_type: str  # config.json's model_type (transformers), or _class_name (diffusers)
    hf_also_reads: tuple[str, ...] = ()  # other model_types whose folders its adapter reads (Kimi K2's: DeepSeek V3's)
    output: str = "output.weight"  # the output head's parameter (optimizer.output_lr_multiplier)
    param_role: Callable[[str, tuple[int, ...]], str | None] | None = None  # (name, shape) -> an optimizer role
    # (tessera.param_groups.ROLES) where the family's differs from the rules on names and shapes; None: the rules'
    options: type | None = None  # its own options: a dataclass of tessera.config.sections.opt fields, mounted as
    # the config section named after the family ([flux]), shown by --help and saved in each run's config.toml
    check: Callable[[Any, Any, Any], None] | None = None  # (cfg, args, dims): its checks of its section and of what
    # it needs of the rest, before any rank starts; ValueError "key: why; fix"
    moved_options: Mapping[str, str] = field(default_factory=dict)  # {old key elsewhere: its option}: older configs
    # still load, with one warning line
    lora: bool = True  # its plan adds [lora]'s adapters (tessera.lora.apply_lora); False: [lora] is refused
    own_data: bool = False  # it brings its own data (ModelSpec.training) and checks it in `check`, in place of the text
    # data's checks
    metrics: Mapping[str, str] = field(default_factory=dict)  # {metric it adds: its label on the console line}
    qk_clip: Callable[[Any], Mapping[str, tuple[tuple[int, float], ...]]] | None = None  # (args) -> {projection of
    # an attention module (one holding a CausalSDPA `sdpa`): per head, its output rows as (rows, power of gamma)
    # segments}: how QK-clip (optimizer.qk_clip_threshold, tessera.qk_clip) scales a head; None: it takes none
    trains_only: Callable[[Any, int], tuple[str, ...] | None] | None = None  # (cfg, step) -> the only parameters
    # that train in that optimizer step (0-based), those whose names hold one of these; the others keep no gradient
    # (no update, no weight decay, out of the grad norm); None: all. DeepSeek V3.2's indexer-only dense warm-up
    trains_absent_parts: Callable[[Any], bool] | None = None  # (cfg): whether the run trains parts that its
    # adapter's fit_to_weights may find absent from a Hugging Face folder (then they start freshly initialized)

    def spec(self) -> ModelSpec:
        module, _, attr = self.torch_side.partition(":")
        return getattr(importlib.import_module(module), attr)
