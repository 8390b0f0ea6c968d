"""algo.mask_truncated (DAPO's overlong filtering): a completion with no stop id adds
nothing to the gradient, and a minibatch of truncated rows only is a no-op step.

The reference for "zero gradient" is the same update on the same batch with that row's
mask zeroed by hand: the two compute the same float ops, so their gradients are equal
to float32 rounding of identical operations (compared at 1e-7, and the truncated row's
advantage is then changed by a large amount, which must not move the gradient at all)."""
import copy

import pytest
import torch

from test_engine_update import _batch, _settings, tiny  # noqa: F401  (tiny: a fixture)

from rlctl.dist.backends import build_backend
from rlctl.train.update import UpdateState, update_policy


class RecordingBackend:
    """One process; ``step`` records the gradients instead of moving the weights."""
    dp_loss_scale = 1.0

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def step(self):
        self.grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                      for p in self.model.parameters()]
        return torch.stack([g.norm() for g in self.grads]).norm()

    def all_reduce(self, t, op="sum"):
        return t

    def backward(self, loss):
        loss.backward()


def _grads(model, batch, mask_truncated):
    backend = RecordingBackend(model)
    s = _settings("token-mean", 0)
    s.algo.mask_truncated, s.share_prompts = mask_truncated, False
    metrics = update_policy(model, backend, batch, s, UpdateState())
    return backend.grads, metrics


def _close(a, b, tol=1e-7):
    return all(torch.allclose(x, y, atol=tol, rtol=0) for x, y in zip(a, b))


def test_a_truncated_row_contributes_zero_gradient(tiny):  # noqa: F811
    model, tok = tiny
    batch = _batch(tok)                                   # row 0 ran to the limit: truncated
    assert batch.truncated.tolist() == [True, False, False, False, False, False]
    by_hand = batch.replace(mask=batch.mask * torch.tensor([0., 1, 1, 1, 1, 1])[:, None])
    masked, m = _grads(model, batch, True)
    reference, _ = _grads(model, by_hand, False)
    assert _close(masked, reference)
    louder = batch.replace(advantages=batch.advantages + 50.0 * torch.eye(6, 1).double())  # row 0 only
    assert _close(_grads(model, louder, True)[0], masked)
    assert not _close(_grads(model, louder, False)[0], _grads(model, batch, False)[0], 1e-4)
    assert all(torch.isfinite(v).all() for v in m.values())


def test_all_rows_truncated_is_a_no_op_step_without_nan(tiny):  # noqa: F811
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    backend = build_backend("torch", "cpu")
    engine = backend.prepare(model, None, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1,
                             warmup_steps=0, max_grad_norm=1.0)
    s = _settings("token-mean", 0)
    s.algo.mask_truncated, s.share_prompts = True, False
    batch = _batch(tok)
    update_policy(engine, backend, batch, s, UpdateState())      # Adam now has momentum
    before = copy.deepcopy(backend.unwrap().state_dict())
    everything = batch.replace(truncated=torch.ones(6, dtype=torch.bool))
    metrics = update_policy(engine, backend, everything, s, UpdateState())
    after = backend.unwrap().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
    assert float(metrics["policy/loss"]) == 0.0 and float(metrics["optim/grad_norm"]) == 0.0
    # without mask_truncated the same step moves the weights (the test can fail)
    s.algo.mask_truncated = False
    update_policy(engine, backend, everything, s, UpdateState())
    assert not all(torch.equal(before[k], backend.unwrap().state_dict()[k]) for k in before)
    backend.close()


@pytest.mark.parametrize("value", [True, False])
def test_config_reaches_update_settings(value):
    from rlctl.config.compose import compose
    from rlctl.train.update import UpdateSettings

    cfg = compose([f"algo.mask_truncated={str(value).lower()}"]).cfg
    assert UpdateSettings.from_config(cfg, share_prompts=True).algo.mask_truncated is value


@pytest.mark.parametrize("overrides, knob", [
    (["algo.rollout_correction.enabled=true", "algo.rollout_correction.mode=mask",
      "algo.rollout_correction.lower=1.5", "algo.rollout_correction.upper=2"],
     "algo.rollout_correction"),             # w = pi_old / pi_engine ~ 1: outside the band
    (["algo.mask_truncated=true", "rollout.max_new_tokens=1"], "algo.mask_truncated"),
])
def test_a_step_that_trains_nothing_says_so_once(make_trainer, capsys, overrides, knob):
    """Every row masked (the correction's band, or all rows truncated): grad norm 0 and one
    warning line naming the knob, not repeated at the next step."""
    tr = make_trainer(overrides + ["trainer.prompts_per_step=2", "algo.group_size=2",
                                   "trainer.eval_every=0", "logger.samples.every=0"])
    values = tr.step(1)
    assert values.get("rollout_corr/masked_frac", values.get("rollout/masked_frac")) == 1.0
    assert values["optim/grad_norm"] == 0.0
    err = capsys.readouterr().err
    assert err.count("rlctl: warning:") == 1 and knob in err and "nothing trained" in err
    tr.step(2)
    assert "warning" not in capsys.readouterr().err
