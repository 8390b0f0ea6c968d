"""Episodes played by local engine processes (rlctl/rollout/engines/engine_source.py): the engine
plays the rows and seed the learner drew with its copy of the weights and sends the
episodes back with their token rewards. At max_staleness=0 the run is the synchronous
episode loop bit for bit (same RNG stream, same weights, same environment seeds); at
max_staleness=1 rollouts are one step old and the ratio against their behaviour
log-probs is logged; the episodes' records cross the process boundary intact, and the
held-out eval plays episodes (the learner's player)."""
import pytest

from episode_runs import build_trainer, env_file, run_args
from rlctl.types import MODEL, OBSERVATION

ASYNC = ["trainer.async_rollout.enabled=true"]


@pytest.fixture
def trainers():
    made = []

    def make(overrides):
        made.append(build_trainer(overrides))
        return made[-1]
    yield make
    for tr in made:
        tr.close()


def _steps(tr, n):
    return [tr.step(i) for i in range(1, n + 1)]


def test_async_episodes_at_zero_staleness_are_the_sync_loop(trainers, tmp_path):
    args = run_args(env_file(tmp_path))
    sync = _steps(trainers(args), 3)
    asyn = _steps(trainers(args + ASYNC + ["trainer.async_rollout.max_staleness=0"]), 3)
    keys = [k for k in sync[0] if not k.startswith(("time/", "perf/"))]
    assert "episode/turns_mean" in keys and "episode/success_rate" in keys
    for s, a in zip(sync, asyn):
        assert {k: (s[k], a.get(k)) for k in keys if s[k] != a.get(k)} == {}
        assert a["async/staleness"] == 0
    assert any(sync[0][k] != sync[1][k] for k in keys)      # the steps differ: the check can fail


def test_stale_async_episodes_keep_their_records_and_behaviour_logprobs(trainers, tmp_path):
    tr = trainers(run_args(env_file(tmp_path)) + ASYNC + ["trainer.async_rollout.max_staleness=1"])
    steps = _steps(tr, 3)
    held_out = tr._evaluate(3)                               # what train() logs at an eval step
    assert 0 <= held_out["eval/success_rate"] <= 1 and held_out["eval/turns_mean"] >= 1
    assert [s["async/staleness"] for s in steps] == [0, 1, 1]
    assert steps[2]["policy/ratio_std"] > 0                  # stale: pi / pi_behaviour != 1
    assert all(1 <= s["episode/turns_mean"] <= 3 for s in steps)
    assert all(s["episode/tool_calls_mean"] == s["episode/turns_mean"] for s in steps)  # 1 per step
    batch = tr.source.sample(2)                              # one more, as the learner gets it
    assert batch.num_sequences == 4 and len(batch.episodes.records) == 4
    for i, e in enumerate(batch.episodes.records):
        model_cols = [c for s in e.spans if s.role == MODEL for c in range(s.start, s.end)]
        obs_cols = [c for s in e.spans if s.role == OBSERVATION for c in range(s.start, s.end)]
        assert batch.mask[i].nonzero().flatten().tolist() == model_cols
        assert (batch.logprobs.old[i, model_cols] < 0).all()
        assert (batch.logprobs.old[i, obs_cols] == 0).all()
        ends = [s.end - 1 for s in e.spans if s.role == MODEL]
        assert batch.episodes.token_rewards[i].nonzero().flatten().tolist() == \
            [c for c, r in zip(ends, e.turn_rewards) if r != 0]
        assert float(batch.episodes.token_rewards[i].sum()) == pytest.approx(sum(e.turn_rewards))  # rule: sum
        assert float(batch.rewards[i]) == pytest.approx(sum(e.turn_rewards))
        assert batch.prompts[i].endswith(" +") and batch.completions[i]
