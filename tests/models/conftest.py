"""Fixtures: the shipped tiny model, built once per session into a temporary cache.
(Threads are pinned to 1 by tests/conftest.py.)"""
import os

import pytest
from omegaconf import OmegaConf

from rlctl.models.tiny import build_tiny

TINY_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "rlctl", "conf", "model",
                         "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_cfg():
    """The shipped tiny-model config (so the tests check the calibrated values)."""
    cfg = OmegaConf.to_container(OmegaConf.load(TINY_YAML))
    return {k: cfg[k] for k in ("hidden_size", "num_layers", "num_heads", "warmup_steps",
                                "warmup_lr")}


@pytest.fixture(scope="session")
def tiny_dir(tiny_cfg, tmp_path_factory):
    """The configured tiny model, built once per session into a temporary cache."""
    return build_tiny(**tiny_cfg, cache_dir=tmp_path_factory.mktemp("rlctl_cache"))


@pytest.fixture(scope="session")
def tiny(tiny_dir, tiny_cfg):
    from rlctl.models import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny", cache_dir=tiny_dir.parent, **tiny_cfg)


@pytest.fixture(scope="session")
def real_arch(tmp_path_factory):
    """``real_arch(family)`` -> directory of that family's small random-init model
    (tests/models/real_arch.py: llama, qwen2, gpt2, gemma), built once per session."""
    from real_arch import build_family

    root, built = tmp_path_factory.mktemp("real_arch"), {}

    def get(name):
        if name not in built:
            built[name] = build_family(name, root / name)
        return built[name]
    return get
