"""The rules an episode's numbers follow (rlctl.envs.environment, the episode loop, the
sample tables and the update): one success for training and eval, ``done``/``success``
as real bools, the stop id that ended the last turn, and ``truncated`` (what
``algo.mask_truncated`` leaves out) meaning a last model turn cut by a length limit.

Stop ids of every vocabulary token make each model turn one token long, ended by its stop
id, so layouts are known without reading the model's samples."""
import numpy as np
import pytest
import torch
from test_episodes import ROWS, Scripted, play, tiny  # noqa: F401  (tiny: a fixture)

import learner_kit
from rlctl.envs.environment import EnvTask, step_flag
from rlctl.rollout.episodes.loop import EpisodePlayer
from rlctl.train.evaluate import evaluate, means
from rlctl.train.metrics import episode_metrics, reduce_metrics, train_rows
from rlctl.train.update import UpdateState, update_mask, update_policy
from rlctl.types import DONE, TURN_LIMIT, Step
from episode_runs import player_settings


class _OneRank:
    world_size, rank, dp_loss_scale = 1, 0, 1.0

    def __init__(self, model=None):
        self.model = model

    def all_reduce(self, t, op="sum"):
        return t

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def backward(self, loss):
        loss.backward()

    def step(self):      # the gradient norm; the weights stay
        return torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None]).norm()


def every_token(tok):
    return tuple(range(len(tok)))


@pytest.mark.parametrize("rewards, info, expected", [
    ([1.0], {}, 1.0),                    # no info["success"]: total reward 1 > 0
    ([0.0], {}, 0.0),
    ([0.0], {"success": True}, 1.0),     # the environment's word wins
    ([1.0], {"success": False}, 0.0),
])
def test_success_is_one_rule_in_training_metrics_and_eval(tiny, rewards, info, expected):
    """episode/success_rate of a played batch and eval's success_rate of the same episodes
    (one turn, done) are the same number, derived from the rule."""
    model, tok = tiny
    make = lambda: Scripted(["1"], rewards=rewards, done_after=1, info=info)   # noqa: E731
    batch = play(tiny, make, max_new_tokens=2)
    trained = reduce_metrics(episode_metrics(batch), _OneRank())["episode/success_rate"]
    s = player_settings(group_size=1, max_new_tokens=2, temperature=1.0)
    player = EpisodePlayer(tok, EnvTask("scripted", make, ROWS, ROWS), *s, (tok.eos_token_id,))
    evaluated = means(evaluate(model, tok, ROWS, player=player).sums)["success_rate"]
    assert trained == expected and evaluated == expected


class Flags(Scripted):
    """Never done by itself (the observation '1'); ``done`` and ``info`` as given."""

    def __init__(self, done, info):
        super().__init__(["1"])
        self.done_value, self.info_value = done, info

    def step(self, turn):
        return Step(observation="1", reward=1.0, done=self.done_value, info=dict(self.info_value))


@pytest.mark.parametrize("done, info, errors, status, success", [
    ("false", {}, 3, TURN_LIMIT, True),         # text: an error each step, never done
    (1, {}, 3, TURN_LIMIT, True),               # an int is no bool either
    (np.bool_(True), {}, 0, DONE, True),        # numpy's bool is a bool
    (False, {"success": "False"}, 3, TURN_LIMIT, True),   # ignored: the reward rule decides
    (False, {"success": np.bool_(False)}, 0, TURN_LIMIT, False),
])
def test_done_and_success_must_be_bools(tiny, done, info, errors, status, success):
    """Each bad field is one counted env error per step (3 turns); truthiness never reads it."""
    batch = play(tiny, lambda: Flags(done, info), max_new_tokens=2, max_turns=3, max_tokens=100)
    for e in batch.episodes.records:
        assert (e.env_errors, e.status) == (errors, status)
    assert reduce_metrics(episode_metrics(batch), _OneRank())["episode/success_rate"] == float(success)


def test_a_bad_flag_error_names_its_field():
    with pytest.raises(ValueError, match=r'step info\["success"\] must be a bool, got str'):
        step_flag('info["success"]', "False")


def test_stop_id_is_the_one_that_ended_the_last_turn(tiny):
    """Turns cut by max_new_tokens (no stop ids): stop_id null, even for episodes the
    environment ended; one-token turns ended by their stop id at the turn limit: that id."""
    _, tok = tiny
    cut = play(tiny, lambda: Scripted(["1"], done_after=2), stops=(), max_new_tokens=2)
    rows = train_rows(cut, [0, 1, 2, 3], 1, cut.rewards, tok, ())
    assert all(e.status == DONE for e in cut.episodes.records)
    assert [(r["stop_id"], r["stop_token"], r["finish_reason"]) for r in rows] == [(None, None, DONE)] * 4
    stops = every_token(tok)
    ended = play(tiny, lambda: Scripted(["1"]), stops=stops, max_new_tokens=2, max_turns=2,
                 max_tokens=100)
    rows = train_rows(ended, [0, 1, 2, 3], 1, ended.rewards, tok, stops)
    # columns: turn 1 (1 token) | observation '1' (1 token) | turn 2 (1 token, column 2)
    last = ended.completion_ids[:, 2].tolist()
    assert [r["stop_id"] for r in rows] == last
    assert [r["stop_token"] for r in rows] == tok.convert_ids_to_tokens(last)
    assert [r["finish_reason"] for r in rows] == [TURN_LIMIT] * 4


def _update(model, batch):
    """update_policy with algo.mask_truncated on a played batch, advantages +-1 by row."""
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)[:, None] * batch.mask.double()
    s = learner_kit.settings(mask_truncated=True, share_prompts=False)
    return update_policy(model, _OneRank(model), batch.replace(advantages=adv), s, UpdateState())


def test_mask_truncated_keeps_episodes_ended_by_max_turns_with_complete_turns(tiny):
    """A fixed-horizon environment (never done: every episode ends at max_turns) whose turns
    all end at a stop id trains: nothing masked, a non-zero gradient; the same episodes with
    their turns cut by max_new_tokens are all left out, and the sample table shows their
    advantage as 0, what the update used."""
    model, tok = tiny
    whole = play(tiny, lambda: Scripted(["1"]), stops=every_token(tok), max_new_tokens=2,
                 max_turns=3, max_tokens=100)
    assert [e.status for e in whole.episodes.records] == [TURN_LIMIT] * 4 and not whole.truncated.any()
    m = _update(model, whole)
    assert float(m["rollout/masked_frac"]) == 0.0 and float(m["optim/grad_norm"]) > 0
    cut = play(tiny, lambda: Scripted(["1"]), stops=(), max_new_tokens=2, max_turns=3, max_tokens=100)
    assert cut.truncated.all()
    m = _update(model, cut)
    assert float(m["rollout/masked_frac"]) == 1.0 and float(m["optim/grad_norm"]) == 0.0
    s = learner_kit.settings(mask_truncated=True)
    adv = torch.ones_like(cut.mask, dtype=torch.float64)
    rows = train_rows(cut.replace(advantages=adv), [0, 1], 1, cut.rewards, tok, (), False,
                      update_mask(cut, s.algo))
    assert [r["advantage"] for r in rows] == [0.0, 0.0]
    assert [r["advantage"] for r in train_rows(cut.replace(advantages=adv), [0, 1], 1, cut.rewards,
                                               tok, ())] == [1.0, 1.0]
