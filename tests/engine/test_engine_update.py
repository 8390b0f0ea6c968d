"""The learner's update and advantage stage on the real tiny model."""
import copy

import pytest
import torch

from rlctl.compose import compose
from rlctl.core import get_policy_loss
from rlctl.engine.advantage import AdvantageSettings, compute_advantages
from rlctl.engine.policy import learner_forward
from rlctl.engine.update import UpdateSettings, UpdateState, accumulate_gradients
from rlctl.models import load_model_and_tokenizer
from rlctl.rollout.collect import concat_batches, keep_informative_groups
from rlctl.types import RolloutBatch

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny", **{k: v for k, v in dict(compose([]).cfg.model).items()
                                               if k != "name"})


def _batch(tokenizer, n=6, t=5, seed=0) -> RolloutBatch:
    """A ragged batch: prompts of the task format, completions of lengths 0..t."""
    g = torch.Generator().manual_seed(seed)
    enc = tokenizer(["3 1 4 1 5 ="] * n, return_tensors="pt")
    digits = torch.tensor(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    comp = digits[torch.randint(0, 10, (n, t), generator=g)]                    # [N, T]
    lengths = torch.tensor([t, 3, 1, 0, 4, 2][:n])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()               # [N, T]
    ids = torch.cat([enc["input_ids"], comp], 1)
    attn = torch.cat([enc["attention_mask"], mask.long()], 1)
    b = RolloutBatch(input_ids=ids, attention_mask=attn, mask=mask, truncated=lengths == t,
                     rewards=torch.rand(n, generator=g), group_ids=torch.arange(n) // 3,
                     prompt_len=enc["input_ids"].shape[1], group_size=3,
                     prompts=["p"] * n, completions=["c"] * n)
    b.advantages = torch.randn(n, 1, generator=g).double() * mask.double()
    b.old_logprobs = None
    return b


def _settings(mode, micro):
    return UpdateSettings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                          agg_mode=mode, norm_len=7, epochs=1, minibatches=1, kl_estimator="k3",
                          kl_in_loss=True, max_grad_norm=1.0, temperature=1.0, micro_batch_size=micro)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_accumulation_matches_one_batch(tiny, mode):
    """Invariance: every aggregation mode, k micro-batches == one batch, to 1e-6 (float64),
    with a KL-in-loss term too (reference = a perturbed copy)."""
    model, tok = tiny
    model = copy.deepcopy(model).double()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = _batch(tok)
    with torch.no_grad():
        batch.ref_logprobs = learner_forward(ref, batch.input_ids, batch.attention_mask,
                                             batch.prompt_len).logp
    grads = []
    for micro in (0, 1, 4):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, batch, _settings(mode, micro), UpdateState(kl_coef=0.1))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], atol=1e-6, rtol=1e-6)


def test_in_reward_shaping_then_gae_gives_the_seed_example():
    """Seed 002: final reward 1, logp [-1,-.5,-.2], ref [-1.2,-.5,-.4], beta .05, values
    [.5,.6,.8], gamma 1, lam .95. Shaped rewards [-.01, 0, .99]; by hand, deltas
    [.09, .2, .19] and advantages [.09 + .95 * .3805, .2 + .95 * .19, .19]."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])                # one padded position
    b = RolloutBatch(input_ids=torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 5),
                     mask=mask, truncated=torch.tensor([False]), rewards=torch.tensor([1.0]),
                     group_ids=torch.tensor([0]), prompt_len=1, group_size=1, prompts=["p"],
                     completions=["c"])
    b.old_logprobs = torch.tensor([[-1.0, -0.5, -0.2, 0.0]])
    b.ref_logprobs = torch.tensor([[-1.2, -0.5, -0.4, 0.0]])
    s = AdvantageSettings(estimator="gae", std_eps=1e-6, baseline="none", gamma=1.0, lam=0.95,
                          whiten=False, kl_in_reward=True, kl_estimator="k1", overlong_buffer=0,
                          overlong_penalty=1.0, max_new_tokens=4)
    adv, ret = compute_advantages(b, s, kl_coef=0.05, values=torch.tensor([[0.5, 0.6, 0.8, 0.0]]))
    expected = torch.tensor([[0.09 + 0.95 * 0.3805, 0.2 + 0.95 * 0.19, 0.19, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret[:, :3], expected[:, :3] + torch.tensor([[0.5, 0.6, 0.8]]))


def test_outcome_estimator_gets_the_shaped_return():
    """With KL in the reward, an outcome estimator sees R - beta * sum_t k1_t per sequence."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    b = RolloutBatch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                     mask=mask, truncated=torch.tensor([False, False]), rewards=torch.tensor([1.0, 0.0]),
                     group_ids=torch.tensor([0, 0]), prompt_len=1, group_size=2, prompts=["p"] * 2,
                     completions=["c"] * 2)
    b.old_logprobs = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
    b.ref_logprobs = torch.tensor([[-2.0, -1.0], [-1.0, 0.0]])   # k1 sums: 1.0 and -1.0
    s = AdvantageSettings(estimator="reinforce", std_eps=0.0, baseline="none", gamma=1.0, lam=1.0,
                          whiten=False, kl_in_reward=True, kl_estimator="k1", overlong_buffer=0,
                          overlong_penalty=1.0, max_new_tokens=2)
    adv, ret = compute_advantages(b, s, kl_coef=0.5, values=None)
    assert ret is None
    # returns: 1 - 0.5 * 1 = 0.5 and 0 - 0.5 * (-1) = 0.5, broadcast over counted tokens
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [0.5, 0.0]]))


def test_dynamic_sampling_keeps_informative_groups_and_concat_pads(tiny):
    _, tok = tiny
    b = _batch(tok)                      # 2 groups of 3
    b.rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    kept = keep_informative_groups(b)
    assert kept.num_sequences == 3 and kept.rewards.tolist() == [0.0, 1.0, 0.5]
    assert kept.group_ids.tolist() == [0, 0, 0]
    short = b.select(torch.arange(3))
    short.mask, short.input_ids = short.mask[:, :2], short.input_ids[:, :-3]
    short.attention_mask = short.attention_mask[:, :-3]
    short.advantages = short.advantages[:, :2]
    both = concat_batches([short, kept], tok.pad_token_id)
    assert both.mask.shape == (6, 5) and both.mask[:3, 2:].sum() == 0
    assert both.input_ids.shape == (6, b.prompt_len + 5)
    assert both.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
