"""TorchTitan 0.3.0 as a peer of bench_gpu.py: a config registry for its own trainer entry point
(`torchtitan.train.main`, as `python -m torchtitan.train --module gpu_titan --config bench`), and the launcher
that runs it and reads its per-step log.

The config is TorchTitan's own Llama 3 1B / 3B (`model_registry(flavor)`, the same sizes as Tessera's flavors:
tessera/models/llama3/args.py), with what makes the step the same as the other peers': plain cross-entropy on the
whole logits (not its default chunked loss), AdamW at a constant lr, no activation checkpointing, no validation, no
checkpoints, its one-GPU mixed precision (FSDP's MixedPrecisionPolicy on a mesh of 1: bf16 compute, fp32 master
weights), `compile.enable` on the model and the loss, and its Float8 converter on every linear but `lm_head`
(TorchTitan 0.3.0 knows the recipes `rowwise` and `rowwise_with_gw_hp`, not `tensorwise`). Everything else is
TorchTitan's default: FlexAttention (its language models mask by document; gpu_peers.titan_assets writes documents
longer than a window, so the mask is causal), CUDA graphs of the forward + backward. The run's sizes come from
the environment variable TESSERA_TITAN (JSON), since ConfigManager imports this module afresh and calls `bench()`
with no arguments.
"""

import json
import os
import re
import statistics
import sys
import types

ENV = "TESSERA_TITAN"
# "step:  3  loss: ...  memory: 12.34GiB(8.6%)  tps: 1,234  ..." (colours off)
STEP_LINE = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
RECIPES = ("rowwise", "rowwise_with_gw_hp")


def bench():
    """TorchTitan's Trainer.Config for the run described in $TESSERA_TITAN."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import config_registry
    from torchtitan.trainer import Trainer

    run = json.loads(os.environ[ENV])
    converters = [Float8LinearConverter.Config(recipe_name=run["float8"], model_compile_enabled=run["compile"],
                                               filter_fqns=["lm_head"])] if run["float8"] else []
    spec = config_registry.model_registry(run["flavor"], converters=converters)
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        hf_assets_path=run["assets"],
        dump_folder=run["dump"],
        model_spec=spec,
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
        training=TrainingConfig(local_batch_size=run["batch"], seq_len=run["seq_len"], steps=run["steps"],
                                mixed_precision_param="bfloat16", **run.get("training", {})),
        compile=CompileConfig(enable=run["compile"], components=["model", "loss"]),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=run["data"]),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
    )


def stub_triton_kernels() -> None:
    """TorchTitan 0.3.0 imports its async expert-parallel Triton kernels at import time (models/common/moe.py ->
    token_dispatcher.py -> distributed/minimal_async_ep/kernels.py: `import triton`); a dense Llama never calls them.
    Where triton is not installed (CPU dry runs), stand-ins that refuse to run let the trainer import."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def refuse(*args, **kwargs):
        raise RuntimeError("triton is not installed: TorchTitan's expert-parallel kernels cannot run here")

    def kernel(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return refuse
    stub.__getattr__ = kernel
    sys.modules[name] = stub


def dry_run() -> None:
    """Without a GPU (TorchTitan 0.3.0's trainer picks device "cuda" whenever no accelerator is found, and stops at
    torch.cuda.set_device): parse the config as its entry point does, then build its tokenizer and data loader
    and draw one batch."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", "gpu_titan", "--config", "bench"])
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=config.training.seq_len,
                                     local_batch_size=config.training.local_batch_size, snapshot_every_n_steps=None)
    inputs, labels = next(iter(loader))
    model = config.model_spec.model
    print(f"TITAN_DRY_RUN config {type(config).__qualname__} parsed; model {type(model).__qualname__} dim {model.dim}, "
          f"{len(model.layers)} layers, vocab {model.vocab_size}; "
          f"batch {list(inputs['input'].shape)}, labels {list(labels.shape)}, document starts per window "
          f"{(inputs['positions'] == 0).sum(1).tolist() if 'positions' in inputs else 'n/a'}", flush=True)


def main() -> None:
    """Run TorchTitan's trainer in this process (`python gpu_titan.py`), or its dry run (`--dry_run`)."""
    stub_triton_kernels()
    if sys.argv[1:] == ["--dry_run"]:
        return dry_run()
    import torchtitan.train
    sys.argv = [sys.argv[0], "--module", "gpu_titan", "--config", "bench"]
    torchtitan.train.main()


def read_log(text: str, warmup: int, tokens_per_step: int) -> dict:
    """tokens/s (median over the steps after `warmup`), the first step's seconds and the peak reserved GiB, from
    TorchTitan's per-step log lines (tps there is tokens over the time since the previous log line)."""
    steps = {int(s): (float(mem), float(tps.replace(",", ""))) for s, mem, tps in STEP_LINE.findall(text)}
    timed = [tps for step, (_, tps) in steps.items() if step > warmup]
    if not timed:
        return {"status": "failed: no timed step in TorchTitan's log"}
    first = steps.get(1, (0.0, 0.0))[1]
    return {"status": "ok", "tokens_per_s": statistics.median(timed),
            "first_step_s": tokens_per_step / first if first else None,
            "peak_memory_gib": max(mem for mem, _ in steps.values()), "memory_kind": "max reserved"}


if __name__ == "__main__":
    main()
