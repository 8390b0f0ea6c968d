"""`rlctl train` warns in one line for a KL estimator whose gradient misses a KL where it
is placed (k1 in the loss: zero expected gradient; k2/k3 in the reward: biased), and
stays quiet for the defaults (k1 in the reward, k3 in the loss) and without a KL term."""
import json

import pytest

from rlctl.config.compose import compose
from rlctl.train.preflight import kl_placement_warning



@pytest.mark.parametrize("overrides,fragment", [
    (["algo=grpo", "algo.kl.coef=0.05"], None),                                # k3 in the loss
    (["algo=ppo", "algo.kl.coef=0.05"], None),                                 # k1 in the reward
    (["algo=grpo", "algo.kl.coef=0.05", "algo.kl.estimator=k2"], None),
    (["algo=grpo", "algo.kl.estimator=k1"], None),                             # coef 0: no KL term
    (["algo=grpo", "algo.kl.coef=0.05", "algo.kl.estimator=kl"], "zero expected gradient"),
    (["algo=ppo", "algo.kl.coef=0.05", "algo.kl.estimator=k3"], "grad KL(pi||ref) - grad KL(ref||pi)"),
    (["algo=rloo", "algo.kl.coef=0.05", "algo.kl.placement=in_reward", "algo.kl.estimator=k2"],
     "biased gradient"),
])
def test_warning_names_the_pair_and_what_it_follows(overrides, fragment):
    message = kl_placement_warning(compose(overrides).cfg.algo)
    if fragment is None:
        assert message is None
    else:
        assert fragment in message and "algo.kl.estimator=k" in message and "\n" not in message


def test_train_prints_the_warning_once_and_still_trains(tmp_path, rlctl_app):
    """Through the Typer app in-process (the warning is printed to sys.stderr, which the
    runner captures as the console script's stderr)."""
    args = ["train", f"run.output_dir={tmp_path}", "trainer.steps=1", "trainer.eval_every=0",
            "trainer.prompts_per_step=2", "algo.group_size=2", "logger=jsonl",
            "algo.kl.coef=0.05", "algo.kl.estimator=k1"]
    out = rlctl_app(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if "warning" in ln]
    assert lines == ["rlctl: warning: algo.kl.estimator=k1 with algo.kl.placement=in_loss: k1 in the "
                     "loss has zero expected gradient (E[grad log pi] = 0); use k2 (grad KL(pi||ref)) "
                     "or k3 (grad KL(ref||pi)) in the loss"], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {k for r in rows for k in r}
    assert {"kl/k1", "kl/k3", "policy/kl_ref"} <= logged      # both estimates, whatever trains
