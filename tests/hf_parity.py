"""The HF round trip every family's test makes: logits after import and after export equal transformers', and
greedy generation equals theirs; and the checks of decoding caches and launch-time refusals the families share."""

import dataclasses

import torch

from tessera.checkpoint.hf import load_hf, save_hf
from tessera.generate import from_pretrained, generate
from tessera.models import family, hf_args


def initialized(fam, args, seed: int = 0):
    """Family `fam`'s model of `args` on CPU, initialized as training starts it (its param_init, seeded)."""
    with torch.device("meta"):
        model = fam.spec().model(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            model.param_init(name, p, gen)
    return model


def import_hf(name: str, folder, seq: int = 32):
    """(model, args): family `name`'s model of the HF folder's config.json, a RoPE table of `seq` positions, its
    weights loaded; eval mode, on CPU."""
    args = dataclasses.replace(hf_args(name, str(folder)), max_seq_len=seq)
    with torch.device("meta"):
        model = family(name).spec().model(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    load_hf(model.eval(), folder)
    return model, args


def assert_round_trip(theirs, ours, args, hf_class, folder, tmp_path, vocab_size: int = 97) -> None:
    """`theirs`: the transformers model saved in `folder`; `ours`: imported from it (eval, fp32)."""
    tokens = torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
        save_hf(ours, args, tmp_path / "out")
        back = hf_class.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    model, _ = from_pretrained(folder)
    prompt = [3, 17, 42, 5]
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert generate(model, prompt, 12) == want[0, len(prompt):].tolist()


def assert_cached_decoding_equals_whole(model, vocab: int) -> None:
    """A prefill then one token at a time through `model`'s decoding cache gives the logits of the whole sequence."""
    tokens = torch.randint(0, vocab, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_cache(2, 30, torch.float32)
        steps = [model(tokens[:, :11], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(11, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)


def assert_refused(name: str, argv: list[str], world: int, line: str) -> None:
    """Family `name`'s debug model with `argv` on `world` ranks is refused before launch with `line`."""
    import re

    import pytest

    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import parse_args

    with pytest.raises(ConfigError, match="^" + re.escape(line)):
        validate(parse_args(["--model.name", name, "--model.flavor", "debugmodel", *argv]), world)


def assert_steps_do_not_recompile(model, loss, steps: int, strict: set[int], begin_step=None) -> None:
    """Each block of `model` compiled by dynamo (the eager backend: what recompiles is dynamo's, not inductor's), then
    `steps` backwards of `loss(model)`, its side losses weighted as the trainer weighs them and `begin_step(model,
    step)` before each, as the trainer's: the steps in `strict` (from 0) must not recompile."""
    from tessera.models.common.side_loss import SideLoss

    torch._dynamo.reset()
    for block in model.layers.values():
        block.compile(backend="eager")
    sides = [m for m in model.modules() if isinstance(m, SideLoss)]
    try:
        for step in range(steps):
            for side in sides:
                side.weight = 1.0
                side.reset()
            if begin_step is not None:
                begin_step(model, step)
            torch.compiler.set_stance("fail_on_recompile" if step in strict else "default")
            loss(model).backward()
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
