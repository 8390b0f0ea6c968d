"""trainer.compile=true: the learner's forward runs through torch.compile (inductor on
CPU) and gives the eager loop's numbers; generation keeps the eager module."""
import math

import pytest

BASE = ["trainer.prompts_per_step=2", "algo.group_size=4", "trainer.eval_every=0", "trainer.lr=1e-3"]


def _steps(make_trainer, overrides, n=2):
    tr = make_trainer(BASE + overrides)
    return tr, [tr.step(i) for i in range(1, n + 1)]


@pytest.mark.slow   # 40-110 s on 2 cores: inductor compiles the learner forward on CPU
def test_compiled_learner_matches_eager(make_trainer):
    _, eager = _steps(make_trainer, [])
    tr, compiled = _steps(make_trainer, ["trainer.compile=true"])
    assert type(tr.model).__name__ == "OptimizedModule" and tr.policy is not tr.model
    for e, c in zip(eager, compiled):
        assert e["reward/mean"] == c["reward/mean"]          # same samples
        for key in ("policy/loss", "policy/entropy", "optim/grad_norm"):
            assert math.isfinite(c[key])
            assert abs(e[key] - c[key]) <= 1e-4 * max(1.0, abs(e[key])), (key, e[key], c[key])
