"""The episode loop (rlctl/rollout/episodes/loop.py) on a tiny random-init Llama built here,
with scripted environments written against the Environment protocol: the batch's layout,
the learner's log-probs against the behaviour ones, budgets, truncation, errors and time
limits. Every expected value is derived from the environments' scripts, not read back."""
import subprocess
import sys
import time

import pytest
import torch
from episode_runs import model_turn_gaps, player_settings

from rlctl.envs.environment import EnvTask
from rlctl.models.forward import learner_forward
from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.rollout.episodes.loop import EpisodePlayer
from rlctl.types import DONE, MODEL, OBSERVATION, TOKEN_LIMIT, TURN_LIMIT, Example, Step

ROWS = [Example("1 2 +"), Example("3 *")]          # prompts of 4 and 3 tokens (<bos> added)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).double().eval()
    return model, tok


class Scripted:
    """Observations from a list, one per step; done after the last (None: never done)."""

    def __init__(self, observations, rewards=None, done_after=None, info=None):
        self.obs, self.rewards, self.done_after, self.info = observations, rewards, done_after, info

    def reset(self, example, seed):
        self.k = 0
        return example.prompt

    def step(self, turn):
        self.k += 1
        reward = self.rewards[self.k - 1] if self.rewards else 0.0
        done = self.done_after is not None and self.k >= self.done_after
        return Step(observation=self.obs[(self.k - 1) % len(self.obs)], reward=reward, done=done,
                    info=dict(self.info or {}))


def play(tiny, make_env, rows=ROWS, stops=None, seed=0, **settings):
    model, tok = tiny
    s = player_settings(**{"group_size": 2, "max_new_tokens": 3, "temperature": 1.0, **settings})
    task = EnvTask("scripted", make_env, rows, rows)
    torch.manual_seed(seed)
    return EpisodePlayer(tok, task, *s, (tok.eos_token_id,) if stops is None else stops).play(
        model, rows, seed=seed)


def test_layout_of_a_scripted_episode_is_derived_by_hand(tiny):
    """No stop id (stops=()): every model turn is exactly max_new_tokens=2 tokens, so the
    columns are known: turn 2 | obs '+ 1 =' 3 | turn 2 | obs '4' 1 | turn 2, done."""
    _, tok = tiny
    batch = play(tiny, lambda: Scripted(["+ 1 =", "4"], rewards=[0.5, 0.0, 1.0], done_after=3),
                 stops=(), max_new_tokens=2, max_tokens=40, turn_reward="sum")
    P, T = 4, 2 + 3 + 2 + 1 + 2
    assert batch.prompt_len == P and batch.mask.shape == (4, T) and batch.num_sequences == 4
    model_cols = [0, 1, 5, 6, 8, 9]
    expected_mask = torch.zeros(T)
    expected_mask[model_cols] = 1
    assert torch.equal(batch.mask, expected_mask.expand(4, T))
    # attention: 1 on every real token, observations included; the 3-token prompt has one pad
    assert batch.attention_mask[:2].sum(-1).tolist() == [P + T] * 2
    assert batch.attention_mask[2:, 0].tolist() == [0, 0] and batch.attention_mask[2:, 1:].all()
    obs1, obs2 = tok("+ 1 =", add_special_tokens=False)["input_ids"], tok("4", add_special_tokens=False)["input_ids"]
    assert all(batch.completion_ids[i, 2:5].tolist() == obs1 for i in range(4))
    assert all(batch.completion_ids[i, 7:8].tolist() == obs2 for i in range(4))
    # behaviour log-probs on model tokens only; turn rewards on each turn's last column
    assert (batch.logprobs.old[:, [2, 3, 4, 7]] == 0).all() and (batch.logprobs.old[:, model_cols] < 0).all()
    expected_rewards = torch.zeros(T)
    expected_rewards[[1, 6, 9]] = torch.tensor([0.5, 0.0, 1.0])
    assert torch.equal(batch.episodes.token_rewards, expected_rewards.expand(4, T))
    # done, but the last turn was cut by max_new_tokens (no stop id): truncated
    assert batch.rewards.tolist() == [1.5] * 4 and batch.truncated.all()
    e = batch.episodes.records[0]
    assert [(s.role, s.start, s.end) for s in e.spans] == [
        (MODEL, 0, 2), (OBSERVATION, 2, 5), (MODEL, 5, 7), (OBSERVATION, 7, 8), (MODEL, 8, 10)]
    assert e.status == DONE and e.turn_rewards == [0.5, 0.0, 1.0]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]


def test_learner_logprobs_equal_the_behaviour_logprobs_turn_by_turn(tiny):
    """Both are log softmax of the same float64 logits at the same positions: the sampler
    sees each turn's context left-padded by a different amount than the learner's batch,
    so only the summation order of float64 matmuls differs. Per op the relative error is
    eps64 = 2.2e-16; through 2 layers of width 32 (a few hundred accumulations) and a
    log-softmax over |logits| < 10 the bound is ~1e-13, taken as 1e-12. (A float32
    sampler would differ by ~1e-6: the test tells the two apart.)"""
    model, _ = tiny
    batch = play(tiny, lambda: Scripted(["+ 1 =", "7 7 7 7", "2"], done_after=4),
                 max_new_tokens=4, max_tokens=60)
    assert batch.logprobs.old.dtype == torch.float64
    learner = learner_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_len).logp
    for i, s, gap in model_turn_gaps(batch, learner):
        assert gap < 1e-12, (i, s, gap)


def test_an_episode_that_never_ends_stops_at_max_turns_truncated(tiny):
    # no stop id (stops=()): every turn, the last included, ends at max_new_tokens, whatever is drawn
    batch = play(tiny, lambda: Scripted(["1"]), stops=(), max_turns=3, max_tokens=200,
                 max_new_tokens=2)
    assert batch.num_sequences == 4                         # nothing dropped
    assert [e.status for e in batch.episodes.records] == [TURN_LIMIT] * 4
    assert [e.turns for e in batch.episodes.records] == [3] * 4
    assert batch.truncated.all()
    # the last turn is stepped (its reward kept) but no observation follows it
    assert all(e.spans[-1].role == MODEL for e in batch.episodes.records)


def test_the_token_budget_ends_an_episode_and_is_never_exceeded(tiny):
    batch = play(tiny, lambda: Scripted(["5 5 5"]), stops=(), max_turns=50, max_tokens=10,
                 max_new_tokens=3)
    # turn 3 | obs 3 | turn 3 | obs cut to the 1 token left: the budget is spent
    assert [e.status for e in batch.episodes.records] == [TOKEN_LIMIT] * 4 and batch.truncated.all()
    assert (batch.attention_mask[:, batch.prompt_len:].sum(-1) == 10).all()
    e = batch.episodes.records[0]
    assert [(s.role, s.end - s.start, s.truncated) for s in e.spans] == [
        (MODEL, 3, False), (OBSERVATION, 3, False), (MODEL, 3, False), (OBSERVATION, 1, True)]


@pytest.mark.parametrize("side, kept", [("right", "1 2 3"), ("left", "7 8 9")])
def test_long_observations_are_cut_on_the_configured_side(tiny, side, kept):
    _, tok = tiny
    batch = play(tiny, lambda: Scripted(["1 2 3 4 5 6 7 8 9"], done_after=2), stops=(),
                 max_new_tokens=2, max_obs_tokens=3, obs_truncation=side)
    for i, e in enumerate(batch.episodes.records):
        obs = [s for s in e.spans if s.role == OBSERVATION]
        assert len(obs) == 1 and obs[0].truncated
        assert batch.completion_ids[i, obs[0].start:obs[0].end].tolist() == \
            tok(kept, add_special_tokens=False)["input_ids"]


class Raises(Scripted):
    def step(self, turn):
        raise RuntimeError("tool crashed")


class Sleeps(Scripted):
    def step(self, turn):
        time.sleep(2.0)
        return Step(observation="1", done=True)


@pytest.mark.parametrize("env", [Raises, Sleeps])
def test_a_step_that_raises_or_times_out_becomes_an_error_observation(tiny, env):
    t0 = time.perf_counter()
    batch = play(tiny, lambda: env(["1"]), max_turns=2, max_new_tokens=2, step_timeout_s=0.2)
    assert time.perf_counter() - t0 < 1.5           # not 2 s per sleeping step
    for e in batch.episodes.records:
        # turn 1: the error; turn 2: raises again, or its env is still busy (never re-entered)
        assert e.env_errors == 2 and e.status == TURN_LIMIT
        assert [s.text for s in e.spans if s.role == OBSERVATION] == ["error"]


def test_stop_strings_of_the_previous_step_end_the_next_turn(tiny):
    """info["stop"] = ["+"]: a turn ends right after its first '+' token (stop ids off,
    so only the string and max_new_tokens can end it)."""
    _, tok = tiny
    plus = tok.convert_tokens_to_ids("+")
    batch = play(tiny, lambda: Scripted(["1"], done_after=6, info={"stop": ["+"]}), stops=(),
                 max_new_tokens=6, max_tokens=200, max_turns=6, seed=3)
    turns = [batch.completion_ids[i, s.start:s.end].tolist()
             for i, e in enumerate(batch.episodes.records) for s in e.spans[2::2]]   # turns 2..
    assert turns and all(t[-1] == plus and plus not in t[:-1] or len(t) == 6 and plus not in t
                         for t in turns)
    assert any(t[-1] == plus for t in turns)


def test_an_abandoned_step_does_not_block_the_interpreter_exit():
    """Timed from the call's return (the import of torch may take long on a loaded machine)."""
    code = ("import time\nfrom rlctl.rollout.episodes.loop import run_calls\n"
            "out = run_calls([lambda: time.sleep(600)], timeout_s=0.1, concurrency=1)\n"
            "assert out[0].timed_out and out[0].busy()\nprint(time.time(), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert done.returncode == 0 and time.time() - float(done.stdout.split()[-1]) < 60   # not 600


@pytest.mark.parametrize("reward", [None, "one", float("nan"), float("inf"), 1e300, -1e39])
def test_a_reward_that_is_not_a_number_is_an_env_error_not_a_crash(tiny, reward):
    """A step's reward that float() refuses, or that is not finite in float32 (the rewards'
    dtype: 1e300 and -1e39 would be infinite): counted in env_errors, reward 0."""
    batch = play(tiny, lambda: Scripted(["4"], rewards=[reward], done_after=1), stops=(),
                 max_new_tokens=2, max_tokens=40)
    assert [e.env_errors for e in batch.episodes.records] == [1] * 4
    assert [e.turn_rewards for e in batch.episodes.records] == [[0.0]] * 4
    assert batch.rewards.tolist() == [0.0] * 4 and torch.isfinite(batch.episodes.token_rewards).all()


def test_a_turn_that_uses_the_last_budget_token_leaves_no_empty_observation(tiny):
    """max_tokens = max_new_tokens = 2 and no stop id: the first turn takes the whole budget,
    so the observation has no room: the episode ends at the token limit with one model span
    and no (empty, 'truncated') observation span."""
    batch = play(tiny, lambda: Scripted(["+ 1 ="]), stops=(), max_new_tokens=2, max_tokens=2)
    for e in batch.episodes.records:
        assert [(s.role, s.start, s.end) for s in e.spans] == [(MODEL, 0, 2)]
        assert e.status == TOKEN_LIMIT and not any(s.truncated for s in e.spans)
    assert batch.truncated.all() and batch.mask.shape[1] == 2


def test_an_observation_that_is_not_text_is_an_env_error(tiny):
    """Step(observation=123): counted in env_errors, the model sees the error observation."""
    batch = play(tiny, lambda: Scripted([123]), stops=(), max_new_tokens=2, max_tokens=40,
                 max_turns=2)
    for e in batch.episodes.records:
        assert e.env_errors == 1 and e.status == TURN_LIMIT
        assert [s.text for s in e.spans if s.role == OBSERVATION] == ["error"]
