"""The entropy bonus (algo.entropy_coef) as a registered loss term: its gradient through
the learner's update equals the hand-derived gradient of -coef * mean entropy, in float64.

For a categorical p = softmax(z), H = -sum_k p_k log p_k and
dH/dz_j = -p_j (log p_j + H), so d(-c * H)/dz_j = c * p_j (log p_j + H). The test takes
the logits as the parameters (a model whose forward returns them), so that gradient is
checked on the logits themselves, without autograd on the expected side."""
import math

import pytest
import torch

from rlctl.dist.backends import TorchBackend
from learner_kit import settings
from rlctl.core import aggregate, entropy_from_logits
from rlctl.core.losses import LOSS_TERMS, active_terms, entropy_bonus
from rlctl.train.update import UpdateSettings, UpdateState, accumulate_gradients
from rlctl.types import RolloutBatch

V, P, T, N = 5, 2, 3, 2


def test_registry_and_active_terms():
    assert "entropy" in LOSS_TERMS.names()
    assert active_terms({"entropy": 0.0}) == []
    [(name, coef, fn)] = active_terms({"entropy": 0.25})
    assert (name, coef, fn) == ("entropy", 0.25, entropy_bonus)
    with pytest.raises(ValueError, match="unknown loss term"):
        active_terms({"nope": 1.0})


def test_entropy_term_is_minus_entropy():
    ent = torch.tensor([[0.5, 1.0], [2.0, 0.0]], dtype=torch.float64)
    assert torch.equal(entropy_bonus(torch.zeros_like(ent), ent, torch.ones_like(ent)), -ent)


class Logits(torch.nn.Module):
    """A 'model' whose logits are its parameters: [1, P+T, V], the same for every row."""

    def __init__(self, z):
        super().__init__()
        self.z = torch.nn.Parameter(z.clone())

    def forward(self, input_ids, attention_mask=None, **kw):
        out = type("Out", (), {})()
        out.logits = self.z[:, :input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)  # [N, L, V]
        return out


def _settings(coef, agg="token-mean"):
    zero_loss = lambda logp, old, adv, mask, *a: (logp * 0.0, {})  # noqa: E731  only the term
    return settings(policy_loss=zero_loss, clip_low=0.2, clip_high=0.2, agg_mode=agg,
                          norm_len=None, epochs=1, minibatches=1, kl_estimator="k3",
                          kl_in_loss=True, temperature=1.0,
                          share_prompts=False, trim_padding=False,
                          terms=tuple(active_terms({"entropy": coef})))


def _batch(mask):
    ids = torch.randint(0, V, (N, P + T), generator=torch.Generator().manual_seed(0))
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones(N, P + T, dtype=torch.long),
                        mask=mask, truncated=torch.zeros(N, dtype=torch.bool),
                        rewards=torch.zeros(N, dtype=torch.float64), group_ids=torch.zeros(N, dtype=torch.long),
                        prompt_len=P, group_size=N, prompts=[""] * N, completions=[""] * N,
                        advantages=torch.zeros(N, T, dtype=torch.float64))


def _hand_gradient(z, mask, coef):
    """d/dz of -coef * token-mean entropy: the completion token t is scored by position
    P-1+t; each counted (row, t) adds coef * p (log p + H) / (number of counted tokens)."""
    grad = torch.zeros_like(z)
    count = float(mask.sum())
    for t in range(T):
        pos = P - 1 + t
        p = [math.exp(v) for v in z[0, pos].tolist()]
        s = sum(p)
        p = [v / s for v in p]
        h = -sum(v * math.log(v) for v in p)
        rows = float(mask[:, t].sum())
        for j in range(V):
            grad[0, pos, j] = coef * p[j] * (math.log(p[j]) + h) * rows / count
    return grad


def test_entropy_bonus_gradient_matches_hand_derivation_float64():
    torch.manual_seed(1)
    z = torch.randn(1, P + T, V, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)   # 4 counted tokens
    coef = 0.3
    model = Logits(z).double()
    accumulate_gradients(model, TorchBackend(), _batch(mask), _settings(coef), UpdateState())
    expected = _hand_gradient(z, mask, coef)
    assert torch.allclose(model.z.grad, expected, atol=1e-12, rtol=0), (model.z.grad - expected).abs().max()
    assert expected.abs().max() > 1e-3                 # not a vacuous zero
    # and the value: -coef * the token-mean entropy of the counted positions
    ent = entropy_from_logits(z.expand(N, -1, -1)[:, P - 1:P - 1 + T])      # [N, T]
    hand = 0.0                                  # sum over counted tokens of H(p_t), by hand
    for t in range(T):
        p = [math.exp(v) for v in z[0, P - 1 + t].tolist()]
        p = [v / sum(p) for v in p]
        hand += -sum(v * math.log(v) for v in p) * float(mask[:, t].sum())
    assert float(aggregate(-coef * ent, mask, "token-mean")) == pytest.approx(
        -coef * hand / float(mask.sum()), abs=1e-12)


def test_entropy_bonus_off_leaves_no_gradient():
    z = torch.randn(1, P + T, V, dtype=torch.float64)
    model = Logits(z).double()
    accumulate_gradients(model, TorchBackend(), _batch(torch.ones(N, T, dtype=torch.float64)), _settings(0.0), UpdateState())
    assert model.z.grad is None or torch.count_nonzero(model.z.grad) == 0


def test_entropy_coef_reaches_update_settings():
    from rlctl.config.compose import compose
    cfg = compose(["algo.entropy_coef=0.01"]).cfg
    s = UpdateSettings.from_config(cfg, share_prompts=True)
    assert [(n, c) for n, c, _ in s.terms] == [("entropy", 0.01)]
    assert UpdateSettings.from_config(compose([]).cfg, share_prompts=True).terms == ()
