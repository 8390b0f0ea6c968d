"""Multi-turn episodes through the learner: a RolloutBatch laid out as an episode runner
makes it (prompt left-padded; then model turns and observations, right-padded; attention
1 on both, mask 1 on model tokens only), on a 2-layer LlamaForCausalLM in float64.

- the gradient at every observation (and padding) position is exactly 0, and the loss,
  its gradient and the clip/KL/entropy metrics equal a slow per-row loop over the model's
  tokens of each unpadded transcript;
- trim_padding cuts a micro-batch at its rows' last counted column, not at mask.sum
  (which is shorter when observations lie between model turns): same loss and gradient
  with and without the trim;
- GAE over an episode equals GAE over the same sequence with its observations removed;
  outcome estimators get the combined episode reward of each turn-reward rule.
"""
import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlctl.dist.backends import TorchBackend
import learner_kit
from rlctl.core import gae, get_policy_loss, group_advantages, place_turn_rewards
from rlctl.core.losses import active_terms
from rlctl.train.trainer import compute_advantages
from rlctl.models.forward import learner_forward
from rlctl.train.update import UpdateSettings, UpdateState, accumulate_gradients
from rlctl.types import MODEL, OBSERVATION, Episode, EpisodePart, LogProbs, RolloutBatch, Span

F64 = torch.float64
V, P, T = 24, 4, 12
# Each row: (prompt tokens, spans of the completion as (role, length)): m model, o observation
LAYOUTS = [
    (4, [("m", 3), ("o", 3), ("m", 3)]),                        # width 9, 6 counted
    (2, [("m", 4), ("o", 2), ("m", 1), ("o", 3)]),              # ends on an observation
    (3, [("m", 5)]),                                            # one turn: width = mask.sum
    (4, [("m", 2), ("o", 3), ("m", 2), ("o", 2), ("m", 3)]),    # reaches column T - 1
]
TEMPERATURE, CLIP_LOW, CLIP_HIGH, KL_COEF, ENT_COEF = 0.8, 0.2, 0.28, 0.05, 0.01


def tiny_llama() -> LlamaForCausalLM:
    """hidden 32 >= vocabulary 24: the head's W^T [32, 24] is injective (random init), so a
    zero gradient at a final hidden state means a zero gradient at that position's logits."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0)
    return LlamaForCausalLM(cfg).double()


def episode_batch(layouts=LAYOUTS, seed=0, group_size=2) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n = len(layouts)
    ids = torch.randint(1, V, (n, P + T), generator=g)
    attention = torch.zeros(n, P + T, dtype=torch.long)
    mask = torch.zeros(n, T, dtype=F64)
    episodes = []
    for i, (prompt, spans) in enumerate(layouts):
        attention[i, P - prompt:P] = 1
        col, ep = 0, Episode()
        for role, length in spans:
            attention[i, P + col:P + col + length] = 1
            if role == "m":
                mask[i, col:col + length] = 1
            ep.spans.append(Span(MODEL if role == "m" else OBSERVATION, col, col + length, ""))
            col += length
        episodes.append(ep)
    ids = torch.where(attention.bool(), ids, 0)                                    # pad id 0
    return RolloutBatch(input_ids=ids, attention_mask=attention, mask=mask,
                        truncated=torch.zeros(n, dtype=torch.bool), rewards=torch.zeros(n, dtype=F64),
                        group_ids=torch.arange(n) // group_size, prompt_len=P,
                        group_size=group_size, prompts=[""] * n, completions=[""] * n,
                        episodes=EpisodePart(episodes, torch.zeros(n, T, dtype=F64)))


def with_policy_inputs(model, b: RolloutBatch, seed=1) -> RolloutBatch:
    """old/ref log-probs near the model's own (some ratios clipped) and advantages on the
    model tokens; garbage (3.0) on every other column, which must be ignored."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logp = learner_forward(model, b.input_ids, b.attention_mask, P, TEMPERATURE).logp
    m = b.mask

    def noisy(x):
        return torch.where(m.bool(), x, torch.full_like(x, 3.0))

    return b.replace(logprobs=LogProbs(old=noisy(logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=F64)),
                                       ref=noisy(logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=F64))),
                     advantages=noisy(torch.randn(logp.shape, generator=g, dtype=F64)))


def settings(**kw) -> UpdateSettings:
    base = dict(policy_loss=get_policy_loss("ppo_clip"), clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                agg_mode="token-mean", norm_len=None, epochs=1, minibatches=1, kl_estimator="k3",
                kl_in_loss=True, temperature=TEMPERATURE, share_prompts=False,
                terms=tuple(active_terms({"entropy": ENT_COEF})))
    return learner_kit.settings(**{**base, **kw})


def slow_loss(model, b: RolloutBatch):
    """(total loss, policy loss, clip fraction, k3 mean, entropy mean) by a loop over rows
    and model tokens: each row's real tokens alone (no padding), the logit before
    completion column t scores its token. Token-mean over the counted tokens."""
    pg = kl = neg_ent = clipped = 0.0
    count = 0
    for i in range(b.num_sequences):
        real = b.attention_mask[i].bool()
        seq = b.input_ids[i][real]                                       # [prompt + transcript]
        n_prompt = int(real[:P].sum())
        logq = torch.log_softmax(model(input_ids=seq[None]).logits[0] / TEMPERATURE, -1)   # [L, V]
        for t in range(T):
            if b.mask[i, t] == 0:
                continue
            pos = n_prompt + t - 1
            lp = logq[pos, seq[n_prompt + t]]
            adv, ratio = b.advantages[i, t], torch.exp(lp - b.logprobs.old[i, t])
            pg = pg + torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
            clipped += bool(adv < 0 and ratio < 1 - CLIP_LOW or adv > 0 and ratio > 1 + CLIP_HIGH)
            log_r = b.logprobs.ref[i, t] - lp
            kl = kl + torch.exp(log_r) - 1 - log_r                       # k3
            neg_ent = neg_ent + (logq[pos].exp() * logq[pos]).sum()      # -H
            count += 1
    total = (pg + KL_COEF * kl + ENT_COEF * neg_ent) / count
    return total, pg / count, clipped / count, kl / count, -neg_ent / count


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_observation_positions_get_zero_gradient_and_the_loss_is_the_slow_loops():
    model = tiny_llama()
    b = with_policy_inputs(model, episode_batch())
    finals = []                                  # the final hidden states of the training forward

    def keep(module, args, out):
        if out.requires_grad:
            out.retain_grad()
            finals.append(out)

    model.model.norm.register_forward_hook(keep)
    got = accumulate_gradients(model, TorchBackend(), b, settings(), UpdateState(kl_coef=KL_COEF))
    (final,) = finals                                                    # one forward: [N, P + w - 1, H]
    width = final.shape[1] - P + 1                                       # trimmed to 12 (row 3)
    assert width == T
    scored = final.grad[:, P - 1:]                                       # [N, w]: scores column t
    counted = b.mask[:, :width].bool()
    assert (scored[~counted] == 0).all()      # observations and padding: exactly 0
    assert (scored[counted].abs().sum(-1) > 0).all()                     # every model token moves
    slow_model = copy.deepcopy(model)
    slow_model.zero_grad()
    total, pg, clip_frac, k3, entropy = slow_loss(slow_model, b)
    total.backward()
    # float64: padded vs unpadded forwards differ by reordered sums, ~1e-15 relative
    tol = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got["policy/loss"], pg.detach(), **tol)
    torch.testing.assert_close(grads(model), grads(slow_model), **tol)
    assert 0 < clip_frac < 1
    f32 = dict(rtol=1e-6, atol=1e-9)     # token-mean metrics are summed in float32 (update.accumulate_gradients)
    torch.testing.assert_close(got["policy/clip_frac"].double(), torch.tensor(clip_frac, dtype=F64), **f32)
    torch.testing.assert_close(got["kl/k3"].double(), k3.detach(), **f32)
    torch.testing.assert_close(got["policy/entropy"].double(), entropy.detach(), **f32)


@pytest.mark.parametrize("micro", [dict(), dict(micro_batch_size=2), dict(micro_batch_tokens=40)])
def test_trimmed_micro_batches_keep_model_turns_past_the_mask_sum(micro):
    """Row 0's mask sums to 4, but its second turn sits at columns 7..8 (width 9); a
    micro-batch cut at mask.sum would drop it. Trim on and off: the same loss and gradient."""
    layouts = [(3, [("m", 2), ("o", 5), ("m", 2)]), (4, [("m", 3)]),
               (2, [("m", 1), ("o", 1), ("m", 1)]), (4, [("m", 5)])]
    base = tiny_llama()
    b = with_policy_inputs(base, episode_batch(layouts))
    out = {}
    for trim in (True, False):
        model = copy.deepcopy(base)
        m = accumulate_gradients(model, TorchBackend(), b, settings(trim_padding=trim, **micro), UpdateState(kl_coef=KL_COEF))
        out[trim] = (m["policy/loss"], grads(model))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-10, atol=1e-13)


def adv_settings(estimator, **kw) -> UpdateSettings:
    base = dict(estimator=estimator, std_eps=1e-6, baseline="none", gamma=0.9, lam=0.8, whiten=False,
                kl_in_reward=False, kl_estimator="k1", overlong_buffer=0, overlong_penalty=1.0,
                max_new_tokens=T, episode_max_tokens=T)
    return learner_kit.settings(**{**base, **kw})


def with_turn_rewards(b: RolloutBatch, turn_rewards, rule, discount=1.0) -> RolloutBatch:
    ends = [[s.end - 1 for s in ep.spans if s.role == MODEL] for ep in b.episodes.records]
    rewards, token = place_turn_rewards(turn_rewards, ends, T, rule, discount, dtype=F64)
    return b.replace(rewards=rewards, episodes=dict(token_rewards=token))


TURN_REWARDS = [[0.5, 2.0], [1.0, -1.0], [3.0], [0.25, 0.5, 1.0]]   # one per model turn of LAYOUTS


def compressed(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's counted columns moved to the front (the observations removed), 0 after."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        kept = x[i][mask[i].bool()]
        out[i, :kept.numel()] = kept
    return out


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_gae_over_an_episode_equals_gae_with_the_observations_removed(kl_coef):
    b = with_turn_rewards(episode_batch(), TURN_REWARDS, "discounted", 0.9)
    g = torch.Generator().manual_seed(3)
    values = torch.randn(b.mask.shape, generator=g, dtype=F64)
    b = b.replace(logprobs=LogProbs(old=-torch.rand(b.mask.shape, generator=g, dtype=F64),
                                    ref=-torch.rand(b.mask.shape, generator=g, dtype=F64)))
    s = adv_settings("gae", kl_in_reward=True)
    adv, ret = compute_advantages(b, s, kl_coef, values)
    m = b.mask
    short = b.replace(mask=compressed(m, m), episodes=dict(token_rewards=compressed(b.episodes.token_rewards, m)),
                      logprobs=LogProbs(old=compressed(b.logprobs.old, m), ref=compressed(b.logprobs.ref, m)))
    want_adv, want_ret = compute_advantages(short, s, kl_coef, compressed(values, m))
    assert torch.equal(compressed(adv, m), want_adv) and torch.equal(compressed(ret * m, m), want_ret)
    assert (adv[m == 0] == 0).all()
    if kl_coef == 0:        # and with no shaping: plain GAE of the placed turn rewards
        plain, _ = gae(short.episodes.token_rewards, compressed(values, m), short.mask, 0.9, 0.8)
        assert torch.equal(want_adv, plain)


# Episode rewards of TURN_REWARDS under each rule, by hand:
#   last:             2.0, -1.0, 3.0, 1.0
#   sum:              0.5 + 2.0 = 2.5; 1.0 - 1.0 = 0.0; 3.0; 0.25 + 0.5 + 1.0 = 1.75
#   discounted (0.5): 0.5 + 0.5 * 2.0 = 1.5; 1.0 - 0.5 = 0.5; 3.0; 0.25 + 0.25 + 0.25 = 0.75
@pytest.mark.parametrize("rule,discount,want", [("last", 1.0, [2.0, -1.0, 3.0, 1.0]),
                                                ("sum", 1.0, [2.5, 0.0, 3.0, 1.75]),
                                                ("discounted", 0.5, [1.5, 0.5, 3.0, 0.75])])
def test_outcome_estimators_get_the_combined_episode_reward(rule, discount, want):
    b = with_turn_rewards(episode_batch(), TURN_REWARDS, rule, discount)
    want = torch.tensor(want, dtype=F64)
    adv, _ = compute_advantages(b, adv_settings("reinforce"), 0.0, None)   # A = the return
    assert torch.equal(adv, want[:, None] * b.mask)
    adv, _ = compute_advantages(b, adv_settings("grpo"), 0.0, None)
    assert torch.equal(adv, group_advantages(want.view(2, 2)).reshape(-1)[:, None] * b.mask)


def test_episode_shaping_kl_on_counted_tokens_and_overlong_on_the_transcript():
    """reinforce's A = R + sum over counted tokens of -beta * k1 + the overlong penalty.
    Row 0 of LAYOUTS: transcript 9 tokens (3 + 3 + 3), 6 counted; with max_tokens 10 and
    buffer 4 the ramp starts at 6: penalty (6 - 9) / 4 * 1.0 = -0.75 (counted tokens, 6,
    would give 0). Row 2: transcript 5 <= 6: 0."""
    b = with_turn_rewards(episode_batch(), TURN_REWARDS, "sum")
    old = torch.full(b.mask.shape, -1.0, dtype=F64)
    ref = torch.where(b.mask.bool(), -1.5, 7.0).to(F64)         # garbage on observations
    b = b.replace(logprobs=LogProbs(old=old, ref=ref))
    s = adv_settings("reinforce", kl_in_reward=True, overlong_buffer=4, episode_max_tokens=10)
    adv, _ = compute_advantages(b, s, 0.1, None)
    kl = -0.1 * 0.5 * b.mask.sum(-1)                            # k1 = old - ref = 0.5 per counted token
    penalty = torch.tensor([(6 - 9) / 4, (6 - 10) / 4, 0.0, -1.0], dtype=F64)   # transcripts 9, 10, 5, 12
    want = torch.tensor([2.5, 0.0, 3.0, 1.75], dtype=F64) + kl + penalty
    torch.testing.assert_close(adv, want[:, None] * b.mask, rtol=0, atol=1e-14)
    assert math.isclose(float(adv[0, 0]), 2.5 - 0.3 - 0.75, abs_tol=1e-14)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo"])
def test_a_single_turn_row_with_token_rewards_matches_the_plain_path(estimator):
    """token_rewards holding the reward on the last counted token give what rewards alone
    give (the single-turn path, episodes None)."""
    b = episode_batch([(4, [("m", 3)]), (3, [("m", 5)]), (2, [("m", 1)]), (4, [("m", 12)])])
    b = with_turn_rewards(b, [[1.0], [0.0], [2.5], [-1.0]], "sum")
    values = torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    s = adv_settings(estimator)
    episode, _ = compute_advantages(b, s, 0.0, values)
    plain, _ = compute_advantages(b.replace(episodes=None), s, 0.0, values)
    assert torch.equal(episode, plain)
