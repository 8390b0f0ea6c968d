"""Padding trimmed to each micro-batch's longest completion: same gradient, shorter forwards."""
import copy

import pytest
import torch

from rlctl.dist.backends import TorchBackend
from learner_kit import settings
from rlctl.config.compose import compose
from rlctl.core import get_policy_loss
from rlctl.models.forward import learner_forward
from rlctl.train.metrics import Moments
from rlctl.train.update import UpdateState, accumulate_gradients
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.types import LogProbs, RolloutBatch


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny", **{k: v for k, v in dict(compose([]).cfg.model).items()
                                               if k != "name"})


def finished(v):
    """A metric's value: a pooled statistic (`stats.Moments`) finished, a tensor as it is."""
    return v.finish(v) if isinstance(v, Moments) else v


def _batch(tokenizer, lengths, t=8, seed=0) -> RolloutBatch:
    """Completions of the given counted lengths, right-padded with pad tokens to t."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    enc = tokenizer(["3 1 4 1 5 ="] * n, return_tensors="pt")
    digits = torch.tensor(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    lengths = torch.tensor(lengths)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()                    # [N, T]
    comp = torch.where(mask.bool(), digits[torch.randint(0, 10, (n, t), generator=g)],
                       torch.full((n, t), tokenizer.pad_token_id))                 # [N, T]
    b = RolloutBatch(input_ids=torch.cat([enc["input_ids"], comp], 1),
                     attention_mask=torch.cat([enc["attention_mask"], mask.long()], 1), mask=mask,
                     truncated=lengths == t, rewards=torch.rand(n, generator=g),
                     group_ids=torch.arange(n) // 2, prompt_len=enc["input_ids"].shape[1],
                     group_size=2, prompts=["p"] * n, completions=["c"] * n)
    b.advantages = torch.randn(n, 1, generator=g) * mask                          # [N, T]
    b.logprobs = LogProbs(old=b.advantages.new_zeros(n, t) - 2.0,                  # ratio != 1
                          ref=b.advantages.new_zeros(n, t) - 2.5)
    return b


@pytest.mark.parametrize("mode,micro", [("token-mean", 2), ("seq-mean-token-sum-norm", 3),
                                        ("seq-mean-token-mean", 0)])
def test_trimmed_micro_batches_give_the_same_gradient(tiny, mode, micro):
    model, tok = tiny
    batch = _batch(tok, [2, 1, 0, 3, 5, 1])          # T = 8: every micro-batch has padding
    widths, grads, metrics = {}, {}, {}
    for trim in (False, True):
        m = copy.deepcopy(model).train()
        with torch.no_grad():             # a model's first forward also checks its LM head, once
            learner_forward(m, batch.input_ids, batch.attention_mask, batch.prompt_len)
        seen = []
        m.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw["input_ids"].shape[1]),
                                    with_kwargs=True)
        s = settings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                           agg_mode=mode, norm_len=None, epochs=1, minibatches=1, kl_estimator="k3",
                           kl_in_loss=True, temperature=1.0,
                           micro_batch_size=micro, trim_padding=trim, share_prompts=False)
        metrics[trim] = accumulate_gradients(m, TorchBackend(), batch, s, UpdateState(kl_coef=0.1))
        grads[trim] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        widths[trim] = seen
    P = batch.prompt_len
    assert all(w == P + 8 - 1 for w in widths[False])
    assert sum(widths[True]) < sum(widths[False])     # the trim did happen
    if micro == 2:
        assert widths[True] == [P + 2 - 1, P + 3 - 1, P + 5 - 1]
    torch.testing.assert_close(grads[True], grads[False], atol=1e-6, rtol=1e-5)
    assert grads[True].abs().max() > 0
    for k in metrics[False]:
        got, want = (finished(metrics[t][k]) for t in (True, False))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_ratio_max_is_the_maximum_over_micro_batches(tiny):
    """policy/ratio_max is the largest pi/pi_old over the counted tokens of the whole
    batch (recomputed here from one full forward), not a mean of micro-batch maxima."""
    from rlctl.models.forward import learner_forward

    model, tok = tiny
    batch = _batch(tok, [2, 1, 0, 3, 5, 1])
    s = settings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                       agg_mode="token-mean", norm_len=None, epochs=1, minibatches=1,
                       kl_estimator="k3", kl_in_loss=False, temperature=1.0,
                       micro_batch_size=2)
    got = accumulate_gradients(copy.deepcopy(model).train(), TorchBackend(), batch, s, UpdateState())["policy/ratio_max"]
    with torch.no_grad():
        logp = learner_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_len).logp
    ratio = torch.exp(logp - batch.logprobs.old)[batch.mask > 0]
    assert ratio.max() > 1.05 * ratio.mean()         # a max and a mean differ here
    torch.testing.assert_close(got, ratio.max(), atol=1e-4, rtol=1e-4)
