"""trainer.compile=true: the learner's forward runs through torch.compile (inductor on
CPU) and gives the eager loop's numbers; generation keeps the eager module."""
import math

import torch
from omegaconf import OmegaConf

from rlctl.compose import compose
from rlctl.engine.trainer import Trainer
from rlctl.models import load_model_and_tokenizer
from rlctl.sinks import NullSink
from rlctl.tasks import build_task

BASE = ["trainer.prompts_per_step=2", "algo.group_size=4", "trainer.eval_every=0", "trainer.lr=1e-3"]


def _steps(overrides, n=2):
    cfg = compose(BASE + overrides).cfg
    OmegaConf.resolve(cfg)
    model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(cfg.model).items() if k != "name"})
    task = build_task("sorting", **{k: v for k, v in dict(cfg.task).items() if k != "name"})
    torch.manual_seed(0)
    tr = Trainer(cfg, model, tok, task, NullSink())
    out = [tr.step(i) for i in range(1, n + 1)]
    return tr, out


def test_compiled_learner_matches_eager():
    _, eager = _steps([])
    tr, compiled = _steps(["trainer.compile=true"])
    assert type(tr.model).__name__ == "OptimizedModule" and tr.policy is not tr.model
    for e, c in zip(eager, compiled):
        assert e["reward/mean"] == c["reward/mean"]          # same samples
        for key in ("policy/loss", "policy/entropy", "optim/grad_norm"):
            assert math.isfinite(c[key])
            assert abs(e[key] - c[key]) <= 1e-4 * max(1.0, abs(e[key])), (key, e[key], c[key])
