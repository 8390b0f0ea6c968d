"""The learner's settings for tests that call the update or the advantages directly:
``settings(**kw)`` fills what a test leaves out (PPO clip 0.2, token-mean, one pass, k3,
no terms, no correction, grpo, no whitening, no overlong penalty). ``algo`` keys go by
their schema names (clip_low, agg_mode, estimator and whiten by their old ones too)."""
from types import SimpleNamespace

from rlctl.core import get_policy_loss
from rlctl.train.update import UpdateSettings

ALGO = dict(clip_eps=0.2, clip_ratio_c=None, loss_agg_mode="token-mean", norm_len=None, epochs=1,
            minibatches=1, vf_coef=0.0, value_clip=None, mask_truncated=False, advantage="grpo",
            std_eps=1e-6, baseline="none", gamma=1.0, lam=1.0, whiten_advantages=False,
            overlong_buffer=0, overlong_penalty=0.0)
RENAMED = {"clip_low": "clip_eps", "agg_mode": "loss_agg_mode", "estimator": "advantage",
           "whiten": "whiten_advantages"}
DEFAULTS = dict(clip_high=0.2, kl_estimator="k3", kl_in_loss=False, kl_in_reward=False, terms=(),
                rollout_correction=None, share_prompts=True, temperature=1.0, micro_batch_size=0,
                micro_batch_tokens=0, max_new_tokens=1, episode_max_tokens=0)


def settings(**kw) -> UpdateSettings:
    algo = dict(ALGO)
    for key in list(kw):
        if RENAMED.get(key, key) in ALGO:
            algo[RENAMED.get(key, key)] = kw.pop(key)
    kw.setdefault("policy_loss", get_policy_loss("ppo_clip"))
    return UpdateSettings(algo=SimpleNamespace(**algo), **{**DEFAULTS, **kw})
