"""Flux's torch side: its transformer, its plan (parallelize.py) and its hooks."""

from tessera.models.contract import ModelSpec, OwnTraining
from tessera.models.flux.bfl import CONVERSIONS
from tessera.models.flux.checks import release_options
from tessera.models.flux.data import build_loaders, encoded, flow_loss, flux_batch
from tessera.models.flux.model import Flux
from tessera.models.flux.parallelize import STACKS, parallelize
from tessera.models.flux.sample import draw, evaluate

SPEC = ModelSpec(model=Flux, parallelize=parallelize, first_stage=(), last_stage=(), blocks=STACKS,
                 training=OwnTraining(data=build_loaders, batch=flux_batch, loss=flow_loss, evaluate=evaluate),
                 draw=draw, draw_options=release_options, encode=encoded, convert=CONVERSIONS)
