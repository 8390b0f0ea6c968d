"""A factory for Trainers on the shipped tiny model and the sorting task (closed after the test)."""
import pytest
import torch
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.train.trainer import Trainer
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.train.build import prepare_task
from rlctl.train.sources import build_source
from rlctl.sinks import NullSink


@pytest.fixture
def make_trainer():
    made = []

    def make(overrides, wrap=None):
        """``wrap``: applied to the loaded model (after seeding) before the Trainer gets it."""
        cfg = compose(list(overrides)).cfg
        OmegaConf.resolve(cfg)
        model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(cfg.model).items() if k != "name"})
        task = prepare_task(cfg, tok, model, quiet=True)   # as rlctl train prepares it
        torch.manual_seed(0)
        model = wrap(model) if wrap is not None else model
        made.append(Trainer.from_config(cfg, model, tok, task, NullSink(),
                                        source=build_source(cfg, model, tok, task)))
        return made[-1]
    yield make
    for tr in made:
        tr.close()
