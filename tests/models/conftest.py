"""Fixtures: the shipped tiny model and the small real-family models, each built once per
test run into the run's temporary directory (``build_once``, tests/conftest.py: one
worker builds, the others reuse). (Threads are pinned to 1 by tests/conftest.py.)"""
import os
from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from rlctl.config.schema import ModelConfig
from rlctl.demo.tiny import build_tiny

TINY_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "rlctl", "config", "conf", "model",
                         "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_cfg():
    """The shipped tiny-model config, schema defaults under model/tiny.yaml (so the tests
    check the calibrated values)."""
    cfg = {f.name: f.default for f in fields(ModelConfig)}
    cfg.update(OmegaConf.to_container(OmegaConf.load(TINY_YAML)))
    return {k: cfg[k] for k in ("hidden_size", "num_layers", "num_heads", "warmup_steps",
                                "warmup_lr")}


@pytest.fixture(scope="session")
def tiny_dir(tiny_cfg, build_once):
    """The configured tiny model, built once per test run into a temporary cache."""
    return build_once("rlctl_cache", lambda cache: build_tiny(**tiny_cfg, cache_dir=cache))


@pytest.fixture(scope="session")
def tiny(tiny_dir, tiny_cfg):
    from rlctl.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny", cache_dir=tiny_dir.parent, **tiny_cfg)


@pytest.fixture(scope="session")
def real_arch(build_once):
    """``real_arch(family)`` -> directory of that family's small random-init model
    (tests/models/real_arch.py: llama, qwen2, gpt2, gemma), built once per test run."""
    from real_arch import build_family

    return lambda name: build_once(f"real_arch-{name}", lambda d: build_family(name, d))
