"""MuonClip's QK-clip (optimizer.qk_clip_threshold, tessera/qk_clip.py): the largest logit it records is the largest
score the attention's mask lets through; after a step every head of the first block that went over the threshold
comes back to it exactly, with the same inputs, and the others, the values and the shared RoPE key are untouched;
bad settings are refused in one line. Its layouts (FSDP 2 x TP 2) are in tests/test_parallel_muon.py's launch."""

import dataclasses

import pytest
import torch

from tessera.config import ConfigError
from tessera.models import family
from tessera.models.common.attention import CausalSDPA, allowed, document_chunks
from tessera.qk_clip import QKClip
from tests.hf_parity import initialized

pytestmark = pytest.mark.fast


def test_max_logits_are_the_largest_score_the_mask_lets_through():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 300, 8, generator=gen), torch.randn(2, 2, 300, 8, generator=gen)  # GQA, 2 blocks
    documents = torch.tensor([[0] * 120 + [1] * 180, [0] * 300])
    for window, chunk, docs in ((0, 0, None), (50, 0, documents), (0, 64, documents)):
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3
        mask = allowed(300, 300, window, 0 if docs is not None else chunk)
        if docs is not None:  # chunks count from each document's start (as attend's)
            d = document_chunks(docs, chunk) if chunk else docs
            mask = mask & (d[:, :, None] == d[:, None, :])[:, None]
        want = scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
        kernel = CausalSDPA(window, chunk, scale=0.3)
        torch.testing.assert_close(kernel.max_logits(q, k, docs), want)


def _model(name: str, flavor: str):
    fam = family(name)
    args = dataclasses.replace(fam.flavors[flavor], vocab_size=64, max_seq_len=32)
    return fam, args, initialized(fam, args).train()


# query from a bottleneck (wq_b), or plain (wq); Kimi Linear's MLA blocks (1 and 3) turn no RoPE
# DeepSeek V3.2's sparse attention (DSA, its top 16 of 32 keys) clips the logits of the keys it selects
@pytest.mark.parametrize(("name", "flavor", "first_mla"), [("deepseek_v3", "debugmodel", "0"),
                                                           ("deepseek_v3", "debugmodel_v2", "0"),
                                                           ("deepseek_v3", "v32_debugmodel", "0"),
                                                           ("kimi_linear", "debugmodel", "1")])
def test_heads_over_the_threshold_come_back_to_it_and_nothing_else_moves(name, flavor, first_mla):
    fam, args, model = _model(name, flavor)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    first = model.layers[first_mla].attention
    mla_blocks = sum(hasattr(layer.attention, "sdpa") for layer in model.layers.values())
    probe = QKClip(first, fam.qk_clip(args), 1.0)  # records the first block alone
    model(tokens)
    before = probe.seen[0].clone()
    threshold = float(before.median())  # some heads over it, some under
    clip = QKClip(model, fam.qk_clip(args), threshold)
    assert len(clip.attention) == mla_blocks
    kept = {n: p.clone() for n, p in first.named_parameters()}
    model(tokens)
    probe.reset()
    clip.after_step()
    assert 1 <= int(clip.last[1]) < mla_blocks * args.n_heads  # heads clipped, over every block
    model(tokens)
    torch.testing.assert_close(probe.seen[0], before.clamp(max=threshold), rtol=1e-5, atol=1e-6)
    nope, v = args.qk_nope_head_dim, args.v_head_dim
    wkv_b = first.wkv_b.weight.view(args.n_heads, nope + v, -1)
    torch.testing.assert_close(wkv_b[:, nope:], kept["wkv_b.weight"].view(args.n_heads, nope + v, -1)[:, nope:])
    torch.testing.assert_close(first.wkv_a.weight, kept["wkv_a.weight"])  # the shared RoPE key's rows among them
    over = before > threshold
    moved = (first.wkv_b.weight.view(args.n_heads, -1) != kept["wkv_b.weight"].view(args.n_heads, -1)).any(-1)
    assert torch.equal(moved, over)


@pytest.mark.parametrize("argv, line", [
    (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
     "optimizer.qk_clip_threshold: QK-clip is MuonClip's (Muon's updates grow attention logits), and optimizer.name "
     "is AdamW"),
    (["--optimizer.name", "Muon"], "optimizer.qk_clip_threshold: llama3 says no way to scale its heads' query and key "
                                   "projections (deepseek_v3, kimi_linear do); set it to 0"),
    (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--optimizer.name", "Muon",
      "--parallelism.context_parallel_degree", "2"], "optimizer.qk_clip_threshold: a head's largest logit takes each "
                                                     "query against every key, which context parallelism splits"),
])
def test_settings_it_cannot_take_are_refused_in_one_line(argv, line):
    from tessera.preflight import validate
    from tessera.schema import parse_args

    with pytest.raises(ConfigError, match="^" + line.replace("(", r"\(").replace(")", r"\)")):
        validate(parse_args([*argv, "--optimizer.qk_clip_threshold", "100"]), 2)
