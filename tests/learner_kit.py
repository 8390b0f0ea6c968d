"""The learner's settings for tests that call the update or the advantages directly:
``settings(**kw)`` fills what a test leaves out (PPO clip 0.2, token-mean, one pass, k3,
no terms, no correction, grpo, no whitening, no overlong penalty)."""
from rlctl.core import get_policy_loss
from rlctl.train.update import UpdateSettings

DEFAULTS = dict(clip_low=0.2, clip_high=0.2, clip_ratio_c=None, agg_mode="token-mean",
                norm_len=None, epochs=1, minibatches=1, kl_estimator="k3", kl_in_loss=False,
                kl_in_reward=False, temperature=1.0, micro_batch_size=0, micro_batch_tokens=0,
                share_prompts=True, vf_coef=0.0, value_clip=None, terms=(), mask_truncated=False,
                rollout_correction=None, estimator="grpo", std_eps=1e-6, baseline="none",
                gamma=1.0, lam=1.0, whiten=False, overlong_buffer=0, overlong_penalty=0.0,
                max_new_tokens=1, episode_max_tokens=0)


def settings(**kw) -> UpdateSettings:
    kw.setdefault("policy_loss", get_policy_loss("ppo_clip"))
    return UpdateSettings(**{**DEFAULTS, **kw})
