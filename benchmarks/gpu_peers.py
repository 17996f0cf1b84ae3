"""The peers bench_gpu.py compares, one (peer, flavor, config) per process: the same Llama 3 model, batch, sequence
length and step (forward, cross-entropy on the whole logits, backward, clip to norm 1, AdamW) in

- tessera: `build_trainer` + `train_step` (its data loader included);
- plain: Tessera's `Transformer` in the loop a user would write: bf16 autocast, fused AdamW, `F.cross_entropy`;
  compiled as PyTorch advises for LLMs, block by block (`block.compile()`, and the loss), as Tessera and TorchTitan
  do; Float8: torchao's `convert_to_float8_training` (every linear but `output`);
- hf: `transformers`' `LlamaForCausalLM` (sdpa attention) from the same sizes (`tessera.models.llama3.hf.hf_config`),
  in the same plain loop;
- torchtitan: TorchTitan's own trainer (gpu_titan.py: 0.2.2, the newest release that runs on torch 2.11), in a
  process of its own.

On CUDA the models keep fp32 weights and compute in bf16; on CPU (dry runs) in fp32. tokens/s is the median of the
timed steps, after the warm-up steps (compilation happens in the first one, whose seconds are reported apart).
"""

import dataclasses
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import COMPILE, FLOAT8, ROOT, child_env, make_trainer, sync_for, tessera_argv

PEERS = ("tessera", "plain", "torchtitan", "hf")
# name: (compile, float8 recipe or None)
CONFIGS = {"bf16": (False, None), "compile": (True, None), "compile_float8_rowwise": (True, "rowwise"),
           "compile_float8_tensorwise": (True, "tensorwise")}


def tessera_flags(config: str) -> list[str]:
    compiled, recipe = CONFIGS[config]
    return (COMPILE if compiled else []) + \
        (FLOAT8 + ["--quantize.linear.float8.recipe_name", recipe] if recipe else [])


def median_timing(step, warmup: int, steps: int, sync, tokens_per_step: int) -> dict:
    """`warmup` untimed steps, then `steps` timed one by one: tokens/s of the median step, first step's seconds."""
    seconds = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        loss = step(i)
        sync()
        seconds.append(time.perf_counter() - start)
    timed = seconds[warmup:]
    return {"status": "ok", "tokens_per_s": tokens_per_step / statistics.median(timed), "first_step_s": seconds[0],
            "step_s": timed, "loss": float(loss)}


def run_tessera(flavor: str, config: str, seq_len: int, batch: int, warmup: int, steps: int) -> dict:
    from tessera.train import train_step

    tr = make_trainer(tessera_argv(flavor, seq_len, batch, warmup + steps) + tessera_flags(config))
    return median_timing(lambda i: train_step(tr)[0], warmup, steps, sync_for(tr.world.device), batch * seq_len)


def _float8(model: torch.nn.Module, recipe: str, keep: str) -> None:
    """torchao's Float8 training linears on every nn.Linear but `keep` (the output projection), as Tessera does."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, fqn: fqn != keep)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _loop(model, config: str, device: torch.device, vocab: int, seq_len: int, batch: int, warmup: int, steps: int,
          logits_of, keep: str, blocks) -> dict:
    """The plain training loop around `model` (logits = logits_of(model, tokens)), on random tokens; `blocks`: the
    modules compiled one by one."""
    compiled, recipe = CONFIGS[config]
    if recipe:
        _float8(model, recipe, keep)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, fused=cuda)
    loss_fn = torch.compile(cross_entropy) if compiled else cross_entropy
    for block in blocks if compiled else []:
        block.compile()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, seq_len + 1), device=device, generator=g) for _ in range(2)]

    def step(i: int) -> torch.Tensor:
        tokens = batches[i % 2]
        with autocast:
            logits = logits_of(model, tokens[:, :-1])
        loss = loss_fn(logits, tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return median_timing(step, warmup, steps, sync_for(device), batch * seq_len)


def llama_args(flavor: str, seq_len: int, vocab: int | None):
    """The flavor's sizes; `vocab` for the flavors that take their tokenizer's."""
    from tessera.models.llama3.args import FLAVORS, TAKES_TOKENIZER_VOCAB

    args = dataclasses.replace(FLAVORS[flavor], max_seq_len=seq_len)
    return dataclasses.replace(args, vocab_size=vocab) if flavor in TAKES_TOKENIZER_VOCAB and vocab else args


def run_plain(flavor: str, config: str, seq_len: int, batch: int, warmup: int, steps: int,
              device: torch.device) -> dict:
    from tessera.models.common.decoder import Decoder as Transformer
    from tessera.parallel.init import materialize

    args = llama_args(flavor, seq_len, 256)
    with torch.device("meta"):
        model = Transformer(args)
    materialize(model, device, 0)
    return _loop(model.train(), config, device, args.vocab_size, seq_len, batch, warmup, steps,
                 lambda m, tokens: m(tokens), keep="output", blocks=list(model.layers.values()))


def run_hf(flavor: str, config: str, seq_len: int, batch: int, warmup: int, steps: int, device: torch.device) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.models.llama3.hf import hf_config

    args = llama_args(flavor, seq_len, 256)
    hf = {k: v for k, v in hf_config(args).items() if k not in ("architectures", "torch_dtype", "dtype")}
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf, attn_implementation="sdpa", use_cache=False)).train()
    return _loop(model, config, device, args.vocab_size, seq_len, batch, warmup, steps,
                 lambda m, tokens: m(input_ids=tokens).logits, keep="lm_head", blocks=list(model.model.layers))


def titan_assets(folder: Path) -> tuple[str, str]:
    """A tokenizer (byte-level BPE, 512 tokens, trained in a second) and a local text dataset for TorchTitan's
    c4_test loader (`load_dataset(folder, split="train")`): only their speed matters, and the model's vocabulary
    stays Llama 3's. Each document (256 KB of text) is longer than a window."""
    from bench_data import paragraphs, train_tokenizer

    assets, data = folder / "tokenizer", folder / "data"
    assets.mkdir(parents=True, exist_ok=True)
    data.mkdir(exist_ok=True)
    train_tokenizer(assets, 512, 50)
    with open(data / "train.jsonl", "w") as fh:
        text = ""
        for part in paragraphs("train", 0, 0):
            text += part + "\n\n"
            if len(text) > 2**18:
                fh.write(json.dumps({"text": text}) + "\n")
                text = ""
    return str(assets), str(data)


def titan_refusal(config: str, flavor: str) -> str | None:
    from gpu_titan import FLAVORS, RECIPES, VERSION

    recipe = CONFIGS[config][1]
    if recipe and recipe not in RECIPES:
        return f"skipped: TorchTitan {VERSION}'s Float8 converter has no {recipe} recipe (only {', '.join(RECIPES)})"
    if flavor not in FLAVORS:
        return f"skipped: TorchTitan has no Llama 3 flavor {flavor}"
    return None


def run_titan(flavor: str, config: str, seq_len: int, batch: int, warmup: int, steps: int, timeout: float) -> dict:
    """TorchTitan's trainer in its own process; its log read by gpu_titan.read_log."""
    from gpu_titan import read_log, titan_flags

    if refusal := titan_refusal(config, flavor):
        return {"status": refusal}
    if importlib.util.find_spec("torchtitan") is None:
        return {"status": "skipped: torchtitan is not installed (benchmarks/gpu_wheels.sh fetches its wheels)"}
    with tempfile.TemporaryDirectory(prefix="tessera-titan-") as tmp:
        assets, data = titan_assets(Path(tmp))
        compiled, recipe = CONFIGS[config]
        flags = titan_flags({"flavor": flavor, "seq_len": seq_len, "batch": batch, "steps": warmup + steps,
                             "compile": compiled, "float8": recipe, "assets": assets, "data": data,
                             "dump": str(Path(tmp, "dump"))})
        env = child_env(PYTHONPATH=os.pathsep.join(
            [str(ROOT / "benchmarks"), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        script = str(ROOT / "benchmarks" / "gpu_titan.py")
        # As TorchTitan's run_train.sh launches it: under torchrun, one rank
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script, *flags] \
            if torch.cuda.is_available() else [sys.executable, script, "--dry_run", *flags]
        code, text = run_child(cmd, env, timeout, cwd=tmp)
    if code == 0 and not torch.cuda.is_available():
        line = next((x for x in text.splitlines() if x.startswith("TITAN_DRY_RUN")), "")
        return {"status": "dry run: " + line.removeprefix("TITAN_DRY_RUN ") + "; its trainer needs CUDA"}
    if code == 0:
        return read_log(text, warmup, batch * seq_len)
    return failure(code, text, timeout)


def run_child(cmd: list[str], env: dict, timeout: float, cwd=ROOT) -> tuple[int | None, str]:
    """(exit status or None on timeout, stdout + stderr); on timeout the whole process group (compile workers,
    torchrun's rank) is killed."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]


def failure(code: int | None, text: str, timeout: float) -> dict:
    """The row of a run that printed no result: timeout, OOM, or its last line."""
    if code is None:
        return {"status": f"timeout after {timeout:.0f}s"}
    if "OutOfMemoryError" in text or "out of memory" in text:
        return {"status": "OOM"}
    lines = [x.strip() for x in text.splitlines() if x.strip()] or ["no output"]
    # the exception, rather than what torchrun prints after it
    error = next((x for x in reversed(lines) if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", x)), lines[-1])
    return {"status": f"failed (exit {code}): {error[:300]}", "log_tail": text[-6000:]}
