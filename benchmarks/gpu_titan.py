"""TorchTitan 0.2.2 as a peer of bench_gpu.py: its own trainer (`torchtitan.train.main`, what its run_train.sh
starts), configured by command-line flags, and the parser of its per-step log.

Why 0.2.2: it is the newest release that imports on the GPU machine's torch 2.11 (docs/benchmarks.md: 0.3.0's
trainer imports `torch.distributed.fsdp.DataParallelMeshDims`, which torch 2.11 lacks).

The flags make its step the one of the other peers: Llama 3 at Tessera's sizes (0.2.2 has no 1B or 3B flavor, so
`register_flavors` adds them to its table from tessera/models/llama3/args.py; its model has no tied embeddings,
so its 1B/3B keep an output matrix of their own: the same FLOPs, 263M / 394M more parameters, about 4 / 6 GiB more
with their gradients and AdamW state), its cross-entropy on the whole logits, AdamW at a constant lr, no
activation checkpointing, no validation, no checkpoints, its one-GPU mixed precision (FSDP is off on one GPU: bf16
autocast over fp32 weights), `compile.enable` on the model (block by block) and the loss, and its Float8 converter
on every linear but `output` (recipes tensorwise, rowwise). Its attention is its default for Llama 3: SDPA with
the causal mask, as the other peers'.
"""

import re
import statistics
import sys
import types

VERSION = "0.2.2"
# "step:  3  loss: ...  memory: 12.34GiB(8.6%)  tps: 1,234  ..." (colours off)
STEP_LINE = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")  # its table + register_flavors; debugmodel: vocab 2048


def titan_flags(run: dict) -> list[str]:
    """TorchTitan's flags for a run: `run` has flavor, seq_len, batch, steps, compile, float8 (a recipe or None),
    assets (tokenizer folder), data (dataset folder), dump."""
    flags = ["--model.name", "llama3", "--model.flavor", run["flavor"], "--model.hf_assets_path", run["assets"],
             "--job.dump_folder", run["dump"], "--training.dataset", "c4_test", "--training.dataset_path", run["data"],
             "--training.local_batch_size", str(run["batch"]), "--training.seq_len", str(run["seq_len"]),
             "--training.steps", str(run["steps"]), "--training.mixed_precision_param", "bfloat16",
             "--optimizer.lr", "8e-4", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0",
             "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--metrics.disable_color_printing"]
    if run["compile"]:
        flags += ["--compile.enable", "--compile.components", "model,loss"]
    if run["float8"]:
        flags += ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name",
                  run["float8"], "--quantize.linear.float8.filter_fqns", "output"]
    return flags


def titan_model_args(flavor: str) -> dict:
    """TorchTitan's TransformerModelArgs fields for Tessera's Llama 3 `flavor` (its RoPE scaling included)."""
    from tessera.models.llama3.args import FLAVORS as TESSERA

    a = TESSERA[flavor]
    return {"dim": a.dim, "n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
            "vocab_size": a.vocab_size, "multiple_of": a.multiple_of, "ffn_dim_multiplier": a.ffn_dim_multiplier,
            "norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
            "rope_scaling": {"scaling_factor": a.rope_scaling_factor, "low_freq_factor": a.rope_low_freq_factor,
                             "high_freq_factor": a.rope_high_freq_factor,
                             "original_max_position_embeddings": a.rope_original_max_pos}}


def register_flavors() -> None:
    """Llama 3.2 1B and 3B in TorchTitan's Llama 3 table, at Tessera's sizes (this process only)."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    for flavor in ("1B", "3B"):
        fields = titan_model_args(flavor)
        llama3_args.setdefault(flavor, TransformerModelArgs(
            **{k: v for k, v in fields.items() if k != "rope_scaling"},
            rope_scaling_args=RoPEScalingArgs(**fields["rope_scaling"])))


def stub_triton_kernels() -> None:
    """TorchTitan 0.2.2 imports its MoE index kernels (Triton) at import time (torchtitan/__init__ -> quantization
    -> models/moe/utils.py -> kernels.py: `import triton`); a dense Llama never calls them. Where triton is not
    installed (CPU dry runs), stand-ins that refuse to run let the trainer import."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    name = "torchtitan.models.moe.kernels"
    stub = types.ModuleType(name)

    def refuse(*args, **kwargs):
        raise RuntimeError("triton is not installed: TorchTitan's MoE index kernels cannot run here")

    def kernel(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return refuse
    stub.__getattr__ = kernel
    sys.modules[name] = stub


def dry_run(flags: list[str]) -> None:
    """Without a GPU (TorchTitan's trainer calls torch.cuda.set_device): parse the flags as its entry point does,
    build its tokenizer, data loader and model (on the meta device), and draw one batch."""
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    config = ConfigManager().parse_args(flags)
    spec = get_train_spec(config.model.name)
    tokenizer = spec.build_tokenizer_fn(config)
    loader = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=config)
    inputs, labels = next(iter(loader))
    args = spec.model_args[config.model.flavor]
    args.update_from_config(config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    print(f"TITAN_DRY_RUN config {type(config).__qualname__} parsed; model {type(model).__qualname__} "
          f"{config.model.flavor} dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters; batch {list(inputs['input'].shape)}, "
          f"labels {list(labels.shape)}", flush=True)


def main() -> None:
    """`python gpu_titan.py FLAGS`: TorchTitan's trainer in this process (under torchrun); `--dry_run FLAGS`: its
    dry run."""
    stub_triton_kernels()
    register_flavors()
    flags = sys.argv[1:]
    if flags[:1] == ["--dry_run"]:
        return dry_run(flags[1:])
    import torchtitan.train

    sys.argv = [sys.argv[0], *flags]
    torchtitan.train.main(torchtitan.train.Trainer)


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
