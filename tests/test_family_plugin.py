"""Adding a family touches its own folder and the registry (tessera.models.FAMILIES), nothing else: a tiny family
defined here, with its own option (the [toy] section), its own check and its own metric, is checked by the
launcher's pre-check and trains 3 steps through tessera.train's entry point."""

import sys
import types
from dataclasses import dataclass

import pytest
from launch import read_metrics, run_local

from tessera.config.sections import opt
from tessera.models.common.counts import check_decoder_layout, decoder_counts
from tessera.models.common.decoder import Decoder
from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, decoder_plan
from tessera.models.common.side_loss import SideLoss
from tessera.models.contract import Family, ModelSpec
from tessera.models.llama3 import hf
from tessera.models.llama3.args import FLAVORS

pytestmark = pytest.mark.fast


@dataclass
class ToyOptions:
    logit_penalty: float = opt(1e-3, "weight of the mean squared logit, a side loss", min=0.0)


def check(cfg, args, dims) -> None:
    if cfg.toy.logit_penalty > 1:
        raise ValueError(f"toy.logit_penalty: {cfg.toy.logit_penalty} would drown the loss; keep it at most 1")


class Toy(Decoder):
    """The shared decoder, with the mean squared logit as a side loss (metric toy_penalty)."""

    def __init__(self, args):
        super().__init__(args)
        self.penalty = SideLoss("toy_penalty", "toy.logit_penalty")

    def forward(self, tokens, cache=None, documents=None, positions=None):
        out = super().forward(tokens, cache, documents, positions)
        if not (self.training and self.penalty.weight and cache is None):
            return out
        return self.penalty.attach(out, out.float().square().mean())


SPEC = ModelSpec(model=Toy, parallelize=decoder_plan(DECODER_BLOCK_TP_PLAN, ("output",)),
                 first_stage=("tok_embeddings",), last_stage=("norm", "output"))
FAMILY = Family(name="toy", flavors={"tiny": FLAVORS["tiny"]}, takes_tokenizer_vocab=frozenset({"tiny"}), hf=hf,
                counts=decoder_counts, check_layout=check_decoder_layout, embedding="tok_embeddings.weight",
                high_precision=("output",), torch_side=f"{__name__}:SPEC", hf_model_type="toy", options=ToyOptions,
                check=check, metrics={"toy_penalty": "toy"})


@pytest.fixture
def toy_registered(monkeypatch):
    """The registry with the toy family in it (its folder: a module whose FAMILY it is)."""
    from tessera import models

    folder = types.ModuleType("tessera.models.toy")
    folder.FAMILY = FAMILY
    monkeypatch.setitem(sys.modules, "tessera.models.toy", folder)
    monkeypatch.setattr(models, "FAMILIES", (*models.FAMILIES, "toy"))  # the schema mounts the registry's families


def test_a_family_brings_its_option_check_and_metric(toy_registered, tmp_path, capsys):
    from tessera.config import ConfigError
    from tessera.preflight import validate
    from tessera.schema import help_text, parse_args

    assert "--toy.logit_penalty" in help_text()
    refused = r"^toy.logit_penalty: 2.0 would drown the loss; keep it at most 1$"
    with pytest.raises(ConfigError, match=refused):
        validate(parse_args(["--model.name", "toy", "--model.flavor", "tiny", "--toy.logit_penalty", "2"]), 1)

    history = run_local(tmp_path / "run", "--model.name", "toy", "--training.steps", "3", "--toy.logit_penalty",
                        "0.01")
    assert [r["step"] for r in history] == [1, 2, 3]
    assert all(r["toy_penalty"] > 0 for r in history)  # its metric, named by it
    assert " toy " in capsys.readouterr().out  # and labelled by it on the console line
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert "[toy]\nlogit_penalty = 0.01" in saved  # its section in the effective config
    assert read_metrics(tmp_path / "run") == history

    # Its option reaches its model: at 0 the side loss is skipped, and the loss (on the logits alone) is the same
    # at the first step, whose weights are the same.
    plain = run_local(tmp_path / "plain", "--model.name", "toy", "--training.steps", "3", "--toy.logit_penalty", "0")
    assert "toy_penalty" not in plain[0] and plain[0]["loss"] == history[0]["loss"]
