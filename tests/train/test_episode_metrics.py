"""episode/* metrics of a batch of episodes (rlctl.train.metrics), length/* counting the
model's tokens only, and the sample table's stop id at a multi-turn row's last counted
column (rlctl.train.metrics.endings)."""
import torch

from rlctl.train.metrics import endings
from rlctl.train.metrics import reduce_metrics, rollout_metrics
from rlctl.types import (DONE, MODEL, OBSERVATION, TOKEN_LIMIT, TURN_LIMIT, Episode, EpisodePart,
                         RolloutBatch, Span)

P, T = 2, 8


class _OneRank:
    world_size, rank = 1, 0


def _batch() -> RolloutBatch:
    """Three episodes (completion columns; m model, o observation, . padding):
    row 0  m m o o o m . .   2 turns, 3 observation tokens, done, success, 1 tool call
    row 1  m o o m o o m m   3 turns, 4 observation tokens (one cut), turn limit, no success,
                             2 tool calls, 1 tool error, 1 env error
    row 2  m m m m . . . .   1 turn, token limit, success unknown (turn reward 0.5 > 0)"""
    layout = ["mmooom..", "moomoomm", "mmmm...."]
    mask = torch.tensor([[float(c == "m") for c in row] for row in layout])                 # [3, T]
    real = torch.tensor([[int(c != ".") for c in row] for row in layout])                   # [3, T]
    spans = [[Span(MODEL, 0, 2, ""), Span(OBSERVATION, 2, 5, ""), Span(MODEL, 5, 6, "")],
             [Span(MODEL, 0, 1, ""), Span(OBSERVATION, 1, 3, "", truncated=True), Span(MODEL, 3, 4, ""),
              Span(OBSERVATION, 4, 6, ""), Span(MODEL, 6, 8, "")],
             [Span(MODEL, 0, 4, "")]]
    episodes = [Episode(spans[0], DONE, True, tool_calls=1),
                Episode(spans[1], TURN_LIMIT, False, tool_calls=2, tool_errors=1, env_errors=1),
                Episode(spans[2], TOKEN_LIMIT, None, turn_rewards=[0.5])]
    ids = torch.arange(3 * (P + T)).view(3, P + T) + 5
    return RolloutBatch(input_ids=ids, attention_mask=torch.cat([torch.ones(3, P, dtype=torch.long), real], 1),
                        mask=mask, truncated=torch.tensor([False, True, True]),
                        rewards=torch.tensor([1.0, 0.0, 0.5]), group_ids=torch.arange(3), prompt_len=P,
                        group_size=1, prompts=[""] * 3, completions=[""] * 3,
                        advantages=torch.zeros(3, T), episodes=EpisodePart(episodes, torch.zeros(3, T)))


def test_episode_metrics_by_hand():
    got = reduce_metrics(rollout_metrics(_batch()), _OneRank())
    want = {
        "episode/turns_mean": (2 + 3 + 1) / 3,
        "episode/obs_tokens_mean": (3 + 4 + 0) / 3,       # attention minus counted: 6-3, 8-4, 4-4
        "episode/tool_calls_mean": (1 + 2 + 0) / 3,
        "episode/tool_errors_mean": 1 / 3,
        "episode/env_errors": 1.0,
        "episode/obs_truncated": 1.0,
        "episode/turn_limit_frac": 1 / 3,
        "episode/token_limit_frac": 1 / 3,
        "episode/success_rate": 2 / 3,                    # row 2: unknown, its reward 0.5 > 0
        "length/mean": (3 + 4 + 4) / 3,                   # counted (model) tokens only
        "length/min": 3.0, "length/max": 4.0,
    }
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-6, (k, got[k], v)


def test_no_episodes_no_episode_metrics_and_unknown_success_is_reward_above_zero():
    """No environment sets success: each episode's turn rewards summed > 0 (as eval reads it)."""
    b = _batch()
    assert not [k for k in rollout_metrics(b.replace(episodes=None)) if k.startswith("episode/")]
    for e, rewards in zip(b.episodes.records, ([0.0, 1.0], [0.0, 0.0, 0.0], [-1.0])):
        e.success, e.turn_rewards = None, rewards
    assert reduce_metrics(rollout_metrics(b), _OneRank())["episode/success_rate"] == 1 / 3


class _Tokens:
    @staticmethod
    def convert_ids_to_tokens(i):
        return f"t{i}"


def test_stop_id_is_the_token_at_the_last_counted_column():
    b = _batch()
    ends = endings(b.completion_ids, b.mask, [False, False, True], _Tokens())
    # row 0: width 6 (mask sums to 3): column 5 holds id 5 + P + 5 = 12; row 1: column 7
    # holds 5 + 10 + P + 7 = 24; row 2 truncated: no stop id
    assert [e["stop_id"] for e in ends] == [12, 24, None]
    assert [e["finish_reason"] for e in ends] == ["stop", "stop", "length"]
