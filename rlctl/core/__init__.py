"""rlctl.core: the pure math of RL fine-tuning (stable public API): pure torch functions, no
I/O, config or distributed code. Shape letters: B prompts, G samples per prompt, N = B*G, T
completion tokens, V vocabulary; `mask` 1.0 on the completion tokens that count. Float32 and
bfloat16 in, reductions in float32 (float64 kept), 0 (never NaN) for an all-masked row; losses
return `(loss, detached metrics)` (preference losses: per-pair loss and rewards); registries
take "package.module:function" too."""
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
from .preference import (PREFERENCE_LOSSES, bradley_terry_loss, dpo_sigmoid_loss, ipo_loss,
                         register_preference_loss, simpo_loss)
from .turns import TURN_REWARD_RULES, place_turn_rewards, turn_weights
