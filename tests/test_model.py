"""Llama 3: published sizes, shapes, causality, and logits equal to transformers' LlamaForCausalLM."""

import dataclasses

import pytest
import torch

from tessera.models import num_params
from tessera.models.common.decoder import Decoder as Transformer
from tessera.models.llama3.args import FLAVORS
from tessera.models.llama3.hf import from_hf, hf_config, to_hf
from tessera.parallel.init import materialize

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("flavor,published", [("1B", 1.236e9), ("3B", 3.213e9), ("8B", 8.030e9),
                                              ("70B", 70.554e9), ("405B", 405.853e9)])
def test_parameter_counts_match_published(flavor, published):
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    assert abs(num_params(model) - published) / published < 1e-3


def _tiny(**kw) -> Transformer:
    args = dataclasses.replace(FLAVORS["tiny"], vocab_size=97, max_seq_len=32, **kw)
    with torch.device("meta"):
        model = Transformer(args)
    materialize(model, torch.device("cpu"), seed=0)
    return model


def test_output_shape_and_causality():
    model = _tiny()
    tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (3, 24, 97)
    changed = tokens.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % 97
    after = model(changed)
    torch.testing.assert_close(after[:, :15], logits[:, :15], rtol=0, atol=0)
    assert not torch.allclose(after[:, 15:], logits[:, 15:])


def test_initialization_is_deterministic_and_seed_dependent():
    a, b = _tiny().state_dict(), _tiny().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    args = dataclasses.replace(FLAVORS["tiny"], vocab_size=97, max_seq_len=32)
    with torch.device("meta"):
        c = Transformer(args)
    materialize(c, torch.device("cpu"), seed=1)
    assert not torch.equal(c.state_dict()["layers.0.attention.wq.weight"], a["layers.0.attention.wq.weight"])


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True), dict(rope_scaling_factor=0.0),
                                dict(n_kv_heads=4), dict(rope_original_max_pos=16, rope_scaling_factor=4.0)])
def test_logits_equal_transformers(kw):
    transformers = pytest.importorskip("transformers")
    ours = _tiny(**kw)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(ours.args).items() if k != "rope_scaling"})
    config.rope_parameters = hf_config(ours.args)["rope_parameters"]
    theirs = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = theirs.load_state_dict(to_hf(ours.state_dict()), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if ours.args.tie_embeddings else set())
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    back = from_hf(to_hf(ours.state_dict()))
    assert back.keys() == ours.state_dict().keys()


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 32,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.707, "truncate": False},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", ROPES)
def test_rope_frequencies_equal_transformers(kind):
    """The shared RoPE schedules (tessera.models.common.rope) against transformers' own, to 1e-6."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tessera.models.common.rope import attention_factor, inv_freq

    rope = ROPES[kind]
    original = rope.get("original_max_position_embeddings", 64)
    dynamic = kind == "dynamic"  # transformers keeps the original context there, and takes the length asked
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=dict(rope),
                                      max_position_embeddings=int(original * (1 if dynamic else rope.get("factor", 1))))
    length = 200  # beyond every original context
    if kind == "default":
        theirs, scale = 1.0 / rope["rope_theta"] ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64), 1.0
    else:
        extra = {"seq_len": length} if dynamic else {}
        theirs, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", **extra)
    scaling = None if kind == "default" else rope
    torch.testing.assert_close(inv_freq(64, rope["rope_theta"], scaling, length), theirs.double(), rtol=1e-6, atol=0)
    assert abs(attention_factor(scaling) - scale) < 1e-9


def _reference_attention(q, k, v, ok, sinks=None):
    """Softmax attention spelled out, one (batch, head, query) at a time."""
    out = torch.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                keys = [j for j in range(k.shape[2]) if ok[i, j]]
                scores = torch.stack([q[b, h, i] @ k[b, h // groups, j] / q.shape[-1] ** 0.5 for j in keys])
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h].view(1)])
                probs = scores.softmax(0)[:len(keys)]
                out[b, h, i] = sum(p * v[b, h // groups, j] for p, j in zip(probs, keys, strict=True))
    return out


@pytest.mark.parametrize("window, chunk, sinks", [(0, 0, False), (3, 0, False), (0, 4, False), (3, 0, True),
                                                  (0, 0, True)])
def test_attention_masks_and_sinks_equal_the_spelled_out_softmax(window, chunk, sinks):
    from tessera.models.common.attention import CausalSDPA, allowed

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 10, 8, generator=gen) for n in (4, 2, 2))
    sdpa = CausalSDPA(window, chunk, 4 if sinks else 0)
    if sinks:
        sdpa.sinks.data = torch.randn(4, generator=gen)
    ok = allowed(10, 10, window, chunk)
    assert ok[9].tolist() == [j <= 9 and (not window or j > 9 - window) and (not chunk or j // chunk == 2)
                              for j in range(10)]
    with torch.no_grad():
        torch.testing.assert_close(sdpa(q, k, v), _reference_attention(q, k, v, ok, sdpa.sinks), rtol=1e-5,
                                   atol=1e-5)
        # Decoding: the last 3 queries against all 10 keys see what they saw in the full pass.
        torch.testing.assert_close(sdpa(q[:, :, 7:], k, v), sdpa(q, k, v)[:, :, 7:], rtol=1e-5, atol=1e-5)


# every mask kind the kernels take: (window, chunk, sinks, documents, queries: the last n_q of the keys)
_MASKS = {"causal": (0, 0, False, False, 70), "causal_sinks": (0, 0, True, False, 70),
          "window": (5, 0, False, False, 70), "window_sinks_offset": (6, 0, True, False, 23),
          "chunks": (0, 8, False, False, 70), "documents": (0, 0, False, True, 70),
          "documents_chunks_sinks": (0, 8, True, True, 70), "documents_window_offset": (5, 0, False, True, 41),
          "decoding": (0, 0, True, False, 1)}


@pytest.mark.parametrize("case", sorted(_MASKS))
def test_blockwise_attention_equals_the_materialized_scores_with_gradients(case):
    """The torch path of every mask (blockwise.py: an online softmax over blocks of 7 queries x 9 keys here, a
    backward that recomputes each block) equals the scores materialized under the mask, output and gradients of
    q, k, v and the sinks, within 1e-6 in fp32, with grouped heads."""
    from tessera.models.common.attention import attend, key_sources
    from tessera.models.common.blockwise import attention
    from tests.sparse_reference import masked_attention

    window, chunk, sinks, documents, n_q = _MASKS[case]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, heads, 70, 8, generator=gen, requires_grad=True) for heads in (4, 2, 2))
    s = torch.randn(4, generator=gen, requires_grad=True) if sinks else None
    docs = torch.tensor([[0] * 20 + [1] * 33 + [2] * 17, [0] * 50 + [1] * 20]) if documents else None
    sources, first, q_docs = key_sources(q[:, :, -n_q:], k, v, window, chunk, docs)
    got = attention(q[:, :, -n_q:], sources, first, 0.3, s, q_docs, q_block=7, k_block=9)[0]
    want = masked_attention(q[:, :, -n_q:], k, v, window, chunk, 0.3, s, docs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(attend(q[:, :, -n_q:], k, v, window, chunk, 0.3, s, docs), want, rtol=1e-6,
                               atol=1e-6)  # the kernel's own blocks
    leaves = [t for t in (q, k, v, s) if t is not None]
    grad = torch.randn_like(got, generator=gen)
    for ours, theirs in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad),
                            strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_blockwise_attention_keeps_no_queries_by_keys_tensor():
    """What autograd keeps of the blockwise kernel for backward grows with the sequence, not its square: at 4096
    tokens it holds the inputs, the output and the log-sum-exp, under 1/20 of one [queries x keys] fp32 matrix."""
    from tessera.models.common.attention import attend

    q, k, v = (torch.randn(1, 2, 4096, 16, requires_grad=True) for _ in range(3))
    docs = torch.zeros(1, 4096, dtype=torch.long)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        attend(q, k, v, window=1000, documents=docs)
    assert sum(kept) < 4096 * 4096 * 4 / 20


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window, chunk, sinks, documents", [(0, 0, False, False), (5, 0, True, False),
                                                             (0, 8, False, True), (5, 0, False, True),
                                                             (0, 0, True, True)])
def test_flex_attention_kernel_equals_the_materialized_one(window, chunk, sinks, documents):
    """The CUDA kernel (FlexAttention, sinks folded in from its log-sum-exp), run here eagerly forward, equals
    the materialized scores for every mask, with grouped heads, and for queries that are the last positions of
    the keys (context parallel's chunks). Its backward needs a GPU: benchmarks/check_flex_gpu.py."""
    from tessera.models.common.attention import flex_attend
    from tests.sparse_reference import masked_attention

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 40, 16, generator=gen) for n in (4, 2, 2))
    s = torch.randn(4, generator=gen) if sinks else None
    docs = torch.tensor([[0] * 9 + [1] * 20 + [2] * 11, [0] * 30 + [1] * 10]) if documents else None
    for n_q in (40, 24):  # the whole sequence; its last 24 positions
        got = flex_attend(q[:, :, -n_q:], k, v, window, chunk, 0.3, s, docs)
        want = masked_attention(q[:, :, -n_q:], k, v, window, chunk, 0.3, s, docs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if sinks:  # and the sink mattered
        assert not torch.allclose(flex_attend(q[:, :, -24:], k, v, window, chunk, 0.3, None, docs), got, atol=1e-3)


# Each family's debug model, narrowed where a mask or position rule would not show in 44 tokens: Llama 4's NoPE
# temperature steps every 4 positions, steeply, and its chunks hold 8 (documents of 9 and 35 cross both at other
# offsets).
_PACKED = {"llama3": ("debugmodel", {}), "qwen3": ("debugmodel", {}), "qwen3_moe": ("debugmodel_moe", {}),
           "deepseek_v3": ("debugmodel", {}), "gpt_oss": ("debugmodel", {}),
           "llama4": ("debugmodel", {"floor_scale": 4, "attn_scale": 4.0, "chunk": 8})}


@pytest.mark.parametrize("name", sorted(_PACKED))
def test_documents_packed_into_a_window_equal_each_document_alone(name):
    """Documents packed into one window, with their document numbers and positions reset per document (as the
    trainer makes them for block_causal): each one's logits are those it has alone, within 1e-5 (Llama 4's chunks
    count from each document's start). Without the reset, Llama 4's NoPE temperature follows window positions
    and the second document's logits move (by 6e-4 here, against 2e-7 of rounding with it); without the mask,
    any family's do."""
    from tessera.models import family
    from tessera.models.common.rope import document_positions

    fam = family(name)
    flavor, narrowed = _PACKED[name]
    args = dataclasses.replace(fam.flavors[flavor], vocab_size=97, max_seq_len=64, **narrowed)
    with torch.device("meta"):
        model = fam.spec().model(args)
    materialize(model, torch.device("cpu"), seed=0)
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randint(1, 97, (1, 9), generator=gen), torch.randint(1, 97, (1, 35), generator=gen)
    first[0, 0] = second[0, 0] = 0  # each starts at BOS (id 0 here)
    packed = torch.cat([first, second], dim=1)
    documents = (packed == 0).cumsum(1)
    assert document_positions(documents).tolist() == [[*range(9), *range(35)]]
    with torch.no_grad():
        alone = model(second)
        logits = model(packed, documents=documents, positions=document_positions(documents))
        torch.testing.assert_close(logits[:, :9], model(first), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[:, 9:], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(packed)[:, 9:], alone, atol=1e-3)
        if name == "llama4":
            assert (model(packed, documents=documents)[:, 9:] - alone).abs().max() > 1e-4
