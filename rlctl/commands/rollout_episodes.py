"""`rlctl rollout` of a task played as episodes (``rlctl.envs.base.is_episodic``).

Each episode is played by ``rlctl.rollout.episodes.EpisodePlayer`` (sampled at
rollout.temperature, under rollout.episode's budgets; the G episodes of a prompt share
its environment seed, ``seed`` + the prompt's index in the file) and written as one JSON
object, every turn with its tokens:

    group, sample, split, prompt_index, prompt   as for single-turn rows
    completion      the transcript decoded with its special tokens (as the model saw it)
    token_ids       [int] the whole transcript after the prompt: model turns and
                    observations, in order (padding dropped)
    mask            [int] 1 on the model's own tokens, 0 on observation tokens
                    (same length as token_ids; the learner's loss mask)
    logprobs        [float] the behaviour log-probs (log softmax(logits / temperature))
                    of model tokens, 0.0 on observation tokens
    logprob_sum     float over the model tokens
    length          int   model tokens (= sum(mask)); transcript_length: len(token_ids)
    truncated       bool  the episode did not end with done (status below)
    max_new_tokens, max_turns, max_tokens   the per-turn and per-episode budgets
    eos_token_id, stop_token_ids            as for single-turn rows
    reward          float the episode reward (turn rewards combined by turn_reward)
    turn_rewards    [float] the environment's reward of each model turn
    turn_reward     str   the rule (last | sum | discounted)
    correct         bool  success: the environment's info["success"], else reward > 0
    status          done | turn_limit | token_limit | length_limit
    success         the environment's info["success"] (null when never set)
    num_turns, tool_calls, tool_errors, env_errors, obs_truncated   the episode's counts
    tool_task       bool  the task's environment offers tools
    turns           [{role ("model" | "observation"), start, end (columns of token_ids),
                    text, token_ids, logprobs (model turns; [] on observations),
                    reward (the turn's; 0 on observations), truncated (an observation
                    cut to max_obs_tokens)}]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from rlctl.learner.evaluate import episode_success
from rlctl.learner.metrics import episode_columns, offers_tools
from rlctl.rollout.episodes import EpisodePlayer, EpisodeSettings
from rlctl.types import DONE, MODEL, Episode


@dataclass
class EpisodeDump:
    """Plays a chunk of prompts as episodes and gives their rows (the module docstring)."""
    player: EpisodePlayer
    settings: EpisodeSettings
    tool_task: bool
    seed: int

    @classmethod
    def of(cls, cfg, tokenizer, task, stops) -> "EpisodeDump":
        settings = EpisodeSettings.from_config(cfg)
        return cls(EpisodePlayer(tokenizer, task, settings, stops), settings, offers_tools(task),
                   int(cfg.seed))

    def rows(self, plan, model, start: int, chunk) -> List[dict]:
        """G episodes of each prompt in ``chunk`` (group ids count from ``start``)."""
        g = plan.group
        batch = self.player.play(model, chunk, self.seed + start, group_size=g)
        P = batch.prompt_len
        widths = batch.attention_mask[:, P:].sum(-1).tolist()          # [N] transcript lengths
        ids, mask = batch.completion_ids.tolist(), batch.mask.long().tolist()
        logps, rewards = batch.old_logprobs.double().tolist(), batch.rewards.double().tolist()
        out = []
        for i, episode in enumerate(batch.episodes):
            n = int(widths[i])
            row = {"group": start + i // g, "sample": i % g, "split": plan.split,
                   "prompt_index": start + i // g, "prompt": chunk[i // g].prompt,
                   "completion": batch.completions[i]}
            row.update(self._tokens(ids[i][:n], mask[i][:n], logps[i][:n], plan))
            row.update(self._episode(episode, rewards[i], ids[i], logps[i]))
            out.append(row)
        return out

    def _tokens(self, ids, mask, logps, plan) -> dict:
        lps = [round(v, 6) if m else 0.0 for v, m in zip(logps, mask)]
        s = self.settings
        return {"token_ids": ids, "mask": mask, "logprobs": lps,
                "logprob_sum": round(sum(lps), 6), "length": sum(mask), "transcript_length": len(ids),
                "max_new_tokens": s.max_new_tokens, "max_turns": s.max_turns,
                "max_tokens": s.max_tokens, "eos_token_id": plan.eos, "stop_token_ids": list(plan.stops)}

    def _episode(self, e: Episode, reward: float, ids, logps) -> dict:
        row = {"truncated": e.status != DONE, "reward": reward, "turn_rewards": list(e.turn_rewards),
               "turn_reward": self.settings.turn_reward, "correct": episode_success(e, reward)}
        row.update(episode_columns(e, self.tool_task))     # the sample tables' columns
        row["turns"] = [{**turn, "start": x.start, "end": x.end, "token_ids": ids[x.start:x.end],
                         "logprobs": [round(v, 6) for v in logps[x.start:x.end]] if x.role == MODEL else []}
                        for turn, x in zip(row["turns"], e.spans)]
        return row
