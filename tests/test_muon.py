"""Muon and optimizer parameter groups in one process: the Newton-Schulz iteration against an SVD, the optimizer
against torch.optim.Muon and AdamW, the groups each family gets, and exact resume under Muon."""

import dataclasses
import logging

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from tessera import models
from tessera.config import ConfigError
from tessera.muon import Muon, MuonSettings, orthogonalize
from tessera.optim import build_optimizer
from tessera.param_groups import param_role
from tessera.preflight import validate
from tessera.schema import parse_args
from tests.dist_worker import run_train
from tests.launch import resume_copy
from tests.test_checkpoint import CKPT, _params_equal

QUINTIC = (3.4445, -4.7750, 2.0315)
CUBIC = (1.5, -0.5, 0.0)  # the classic Newton-Schulz step: converges to U V^T


def _random(shape, seed: int, low: float = 0.1) -> torch.Tensor:
    """A random matrix with singular values spread over [low, 1] (so the iteration's convergence is known)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    u, _ = torch.linalg.qr(torch.randn(rows, min(rows, cols), generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, min(rows, cols), generator=g))
    return u @ torch.diag(torch.linspace(low, 1.0, min(rows, cols))) @ v.T


@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (80, 32)])
def test_newton_schulz_against_svd(shape):
    m = _random(shape, seed=sum(shape))
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    # Converged (cubic iteration, fp32): the orthogonal factor U V^T itself.
    torch.testing.assert_close(orthogonalize(m, CUBIC, 40, torch.float32), u @ vh, atol=1e-4, rtol=0)
    # Muon's 5 quintic steps: U S' V^T with the same singular vectors and S' within about [0.7, 1.2].
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        core = u.T @ orthogonalize(m, QUINTIC, 5, dtype).float() @ vh.T
        diagonal = core.diagonal()
        assert (core - torch.diag(diagonal)).abs().max() < tol
        assert diagonal.min() > 0.6 and diagonal.max() < 1.25, diagonal
    # Bit for bit torch's own (torch.optim.Muon's) on a matrix; a batch gives each matrix its own result.
    assert torch.equal(orthogonalize(m, QUINTIC, 5), _zeropower_via_newtonschulz(m, QUINTIC, 5, 1e-7))
    stack = torch.stack([m, 2 * m.flip(0)])
    for one, batched in zip(stack, orthogonalize(stack, QUINTIC, 5, torch.float32), strict=True):
        torch.testing.assert_close(batched, orthogonalize(one, QUINTIC, 5, torch.float32), atol=1e-6, rtol=0)


def test_muon_steps_as_torch_muon_on_matrices_and_adamw_on_the_rest():
    torch.manual_seed(0)
    shapes = [(24, 16), (16, 40), (16,)]
    ours, theirs = [[torch.nn.Parameter(torch.randn(s)) for s in shapes] for _ in range(2)]
    for a, b in zip(ours, theirs, strict=True):
        b.data.copy_(a.data)
    settings = MuonSettings(momentum=0.9, nesterov=True, ns_steps=5, update_scale="match_rms_adamw")
    muon = Muon([{"params": ours[:2], "muon": True}, {"params": ours[2:], "muon": False}], settings, lr=0.02,
                weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    reference = [torch.optim.Muon(theirs[:2], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True,
                                  adjust_lr_fn="match_rms_adamw"),
                 torch.optim.AdamW(theirs[2:], lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)]
    for step in range(3):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(step * 10 + i)) for i, s in enumerate(shapes)]
        for params in (ours, theirs):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        muon.step()
        for opt in reference:
            opt.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert set(muon.state[ours[0]]) == {"momentum_buffer"} and set(muon.state[ours[2]]) >= {"exp_avg", "exp_avg_sq"}


def _groups(family: str, flavor: str, *flags: str) -> list[dict]:
    cfg = parse_args(["--model.name", family, "--model.flavor", flavor, *flags])
    fam = models.family(family)
    with torch.device("meta"):
        model = fam.spec().model(fam.flavors[flavor])
    opt = build_optimizer(model, cfg.optimizer, param_role(fam, fam.spec().blocks))
    names = {id(p): n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k in ("lr", "weight_decay", "muon")},
             "names": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]


def test_param_groups_by_role_and_one_group_by_default(caplog):
    (only,) = _groups("llama3", "tiny")  # a config without the options: the single group (and checkpoints) of before
    assert len(only["names"]) == 21 and only["weight_decay"] == 0.1 and not only["muon"]
    with caplog.at_level(logging.INFO, logger="tessera"):
        groups = _groups("llama3", "tiny", "--optimizer.name", "Muon", "--optimizer.weight_decay_exclude",
                         "--optimizer.embedding_lr_multiplier", "2", "--optimizer.output_lr_multiplier", "0.5",
                         "--optimizer.lr", "1e-3")
    assert groups[0]["lr"] == 1e-3  # the lr logged is the first group's: optimizer.lr
    by_first = {g["names"][0]: g for g in groups}
    embedding, vectors, matrices, output = (by_first[n] for n in ("tok_embeddings.weight", "layers.0.attention_norm."
                                                                  "weight", "layers.0.attention.wq.weight",
                                                                  "output.weight"))
    assert (embedding["lr"], embedding["weight_decay"], embedding["muon"]) == (2e-3, 0.0, False)
    assert (output["lr"], output["weight_decay"], output["names"]) == (5e-4, 0.1, ["output.weight"])
    assert vectors["weight_decay"] == 0.0 and vectors["names"][-1] == "norm.weight" and len(vectors["names"]) == 5
    assert matrices["muon"] and len(matrices["names"]) == 14 and all(n.startswith("layers.") for n in matrices["names"])
    assert "optimizer group: Muon, lr x1, weight decay 0.1: 14 matrix (14 tensors, 98,304 parameters)" in caplog.text
    # Tied embeddings (Qwen 3 0.6B): one group for the weight that is both; experts' matrices go to Muon.
    tied = _groups("qwen3", "0.6B", "--optimizer.embedding_lr_multiplier", "3", "--optimizer.output_lr_multiplier", "2")
    assert [(g["names"], g["lr"]) for g in tied if g["lr"] != 8e-4] == [(["tok_embeddings.weight"], 3 * 8e-4)]
    moe = _groups("qwen3_moe", "debugmodel_moe", "--optimizer.name", "Muon")
    muon_names = next(g["names"] for g in moe if g["muon"])
    assert "layers.0.feed_forward.experts.w1" in muon_names and "layers.0.feed_forward.router.gate.weight" in muon_names
    gpt_oss = _groups("gpt_oss", "debugmodel", "--optimizer.name", "Muon")  # stacked expert biases are no matrices
    assert not any(n.endswith("bias") for g in gpt_oss if g["muon"] for n in g["names"])


def test_family_refines_roles(monkeypatch):
    fam = models.family("llama3")
    monkeypatch.setattr(models, "family", lambda name: dataclasses.replace(
        fam, param_role=lambda name, shape: "vector" if name.endswith("wo.weight") else None))
    groups = _groups("llama3", "tiny", "--optimizer.name", "Muon")
    assert all(not n.endswith("wo.weight") for g in groups if g["muon"] for n in g["names"])


def test_bad_coefficients_and_cpu_offload_refused():
    with pytest.raises(ConfigError, match=r"^optimizer.muon_ns_coefficients: '1,2' is not three finite numbers"):
        validate(parse_args(["--optimizer.muon_ns_coefficients", "1,2"]), 1)
    with pytest.raises(ConfigError, match=r"^optimizer.name: Muon sends matrix shards .* use AdamW with CPU offload$"):
        validate(parse_args(["--optimizer.name", "Muon", "--training.enable_cpu_offload"]), 2)


MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", "--optimizer.weight_decay_exclude",
        "--optimizer.embedding_lr_multiplier", "2"]


def test_exact_resume_under_muon(tmp_path):
    ckpt = [*MUON, *CKPT, "--checkpoint.interval", "2"]
    full = run_train(["--job.dump_folder", str(tmp_path / "full"), *ckpt], 4)
    resumed = run_train(["--job.dump_folder", str(resume_copy(tmp_path / "full", tmp_path / "r", 2)), *ckpt], 4)
    assert resumed["start"] == 2 and resumed["losses"] == {s: full["losses"][s] for s in (3, 4)}
    _params_equal(resumed["params"], full["params"])  # bit for bit: momentum buffers and Adam moments restored
    # Another optimizer state or other groups do not load into this one: refused before any rank starts.
    for flags, line in (([], r"^optimizer.name: 'AdamW', but the optimizer state of the checkpoint at .*step-4 is "
                              r"Muon's with name = 'Muon'; set it back to resume, or add optimizer and lr_scheduler"),
                        (MUON[:-1] + ["1"],
                         r"^optimizer.embedding_lr_multiplier: 1.0, but the optimizer state .* is Muon's with "
                         r"embedding_lr_multiplier = 2.0;")):
        with pytest.raises(ConfigError, match=line):
            validate(parse_args([*CKPT, "--job.dump_folder", str(tmp_path / "full"), "--model.flavor", "tiny",
                                 "--training.seq_len", "32", *flags]), 1)
