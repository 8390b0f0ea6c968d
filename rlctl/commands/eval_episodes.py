"""`rlctl eval` of a task played as episodes (``rlctl.envs.base.is_episodic``).

Greedy episodes (the most likely token each turn) and ``--samples`` sampled episodes per
eval row at ``rollout.temperature``, under the training run's budgets
(``rollout.episode``): success_rate (the environment's info["success"], else total
reward > 0), exact_match (= success_rate, so the single-turn column reads the same),
reward, turns_mean, tool_calls_mean, tool_errors_mean, env_errors_mean, truncated_frac,
length_mean (model tokens per episode), and for the sampled column pass@k over the
successes (rlctl.commands.passk). ``rlctl.learner.evaluate.evaluate_episodes`` plays them,
as the Trainer's eval/* does.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from rlctl.commands.passk import mean_pass_at_k, report_ks
from rlctl.learner.evaluate import evaluate_episodes
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.episodes import EpisodePlayer, EpisodeSettings


def episode_splits(cfg, model, tokenizer, task, examples, samples: int, batch_size: int
                   ) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(greedy metrics, sampled metrics) on ``examples``."""
    player = EpisodePlayer(tokenizer, task, EpisodeSettings.from_config(cfg),
                           stop_ids(model, tokenizer))     # open_target resolved the stop ids
    greedy = _means(evaluate_episodes(model, player, examples, greedy=True,
                                      seed=int(cfg.seed), batch_size=batch_size)[0])
    torch.manual_seed(cfg.seed)
    sums, _, counts = evaluate_episodes(model, player, examples, greedy=False, samples=samples,
                                        seed=int(cfg.seed), batch_size=batch_size)
    sampled = _means(sums)
    for k in report_ks(samples):
        sampled[f"pass@{k}"] = mean_pass_at_k(samples, counts, k)
    return greedy, sampled


def _means(sums: Dict[str, float]) -> Dict[str, float]:
    n = max(sums.pop("count"), 1.0)
    return {k: v / n for k, v in sums.items()}
