"""rlctl.core: the pure math of RL fine-tuning (stable public API).

Pure torch functions: no I/O, no config objects, no distributed code. Shape letters:
B prompts, G samples per prompt, N = B*G sequences, T completion tokens, V vocabulary.
`mask` is 1.0 on completion tokens that count (EOS included; prompt and padding
excluded). Every function accepts float32 and bfloat16, computes reductions in float32
(float64 kept), and returns 0, never NaN, for an all-masked row or all-zero mask.
Losses return `(loss, metrics)` with detached metric tensors. Registries
(``rlctl.registry.Registry``): ``ADVANTAGE_ESTIMATORS``, ``POLICY_LOSSES``, ``KL_ESTIMATORS``
and ``LOSS_TERMS``; their ``get`` also takes "package.module:function"."""
from .advantages import (ADVANTAGE_ESTIMATORS, REINFORCE_BASELINES, broadcast_to_tokens,
                         dr_grpo_advantages, gae, get_advantage_estimator, group_advantages,
                         grpo_advantages, overlong_penalty, register_advantage,
                         reinforce_advantages, reinforce_baseline_advantages, rloo_advantages,
                         zero_std_groups)
from .logprobs import (chunked_token_logprobs, completion_mask, counted_width, entropy_from_logits,
                       masked_mean, masked_sum, masked_whiten, token_logprobs)
from .losses import (AGG_ALIASES, AGG_MODES, KL_ALIASES, KL_DEFAULT_ESTIMATOR, KL_ESTIMATORS,
                     KL_PLACEMENT_NOTES, KL_PLACEMENTS, POLICY_LOSSES, AdaptiveKLController,
                     FixedKLController, agg_denominator, aggregate, aggregate_sum, cispo_per_token,
                     get_policy_loss, gspo_per_token, kl_estimate, kl_shaped_rewards,
                     ppo_clip_per_token, register_kl, register_policy_loss, resolve_agg_mode,
                     resolve_kl_estimator, vanilla_pg_per_token, value_loss_per_token)
from .turns import TURN_REWARD_RULES, place_turn_rewards, turn_weights
