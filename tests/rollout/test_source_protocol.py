"""Every rollout source class offers what ``rlctl.rollout.source.Source`` says the trainer
asks of one: each method its own, with the protocol's parameters."""
import inspect

import pytest

from rlctl.rollout.engines.engine_source import EngineSource
from rlctl.rollout.episodes.loop import EpisodeSource
from rlctl.rollout.source import LocalSource, Source

METHODS = [name for name, v in vars(Source).items() if inspect.isfunction(v) and not name.startswith("_")]


def test_the_protocol_names_what_the_trainer_uses():
    assert sorted(METHODS) == ["after_update", "close", "metrics", "sample"]
    assert sorted(Source.__annotations__) == ["player", "prompt_rng", "scorer"]


@pytest.mark.parametrize("cls", [LocalSource, EpisodeSource, EngineSource])
def test_every_source_class_conforms(cls):
    assert Source in cls.__mro__
    for name in METHODS:
        method, stated = getattr(cls, name), vars(Source)[name]
        assert method is not stated, (cls, name)          # not the protocol's empty body
        assert list(inspect.signature(method).parameters) == list(inspect.signature(stated).parameters)
