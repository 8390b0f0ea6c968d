"""Every rollout source class offers what ``rlctl.rollout.source.Source`` says the trainer
asks of one: each method with the protocol's parameters, each attribute declared."""
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
    for name in METHODS:
        want = list(inspect.signature(vars(Source)[name]).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)
    for name in Source.__annotations__:
        assert any(name in vars(k) or name in vars(k).get("__annotations__", {}) for k in cls.__mro__
                   if k is not object), (cls, name)
