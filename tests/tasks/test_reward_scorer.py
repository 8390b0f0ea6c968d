"""RewardScorer: per-batch time limit (a forked worker killed at the deadline), errors
scored 0 and counted or raised naming the sample, per-reward components.

The reward functions live in a module written to tmp_path and loaded by file path, as a
user's would be (no rlctl component is mocked)."""
import json
import signal
import time

import pytest

from rlctl.errors import RewardError
from rlctl.tasks import RewardScorer, build_task

USER_MODULE = '''
import math, os, time

def ok(prompt, completion, answer, **fields):
    return 1.0 if completion.strip() == str(answer) else 0.0

def sleepy(prompt, completion, **fields):
    if completion == "sleep":
        time.sleep(3600)
    return 0.5

def spin(prompt, completion, **fields):
    if completion == "spin":
        while True:          # pure-Python infinite loop: holds the GIL between ticks
            pass
    return 0.25

def boom(prompt, completion, **fields):
    if completion == "boom":
        raise ZeroDivisionError("user bug")
    return 1.0

def nan(prompt, completion, **fields):
    return float("nan") if completion == "nan" else 1.0

def die(prompt, completion, **fields):
    if completion == "die":
        os._exit(3)
    return 1.0

def batch_boom(prompts, completions, **fields):
    if "boom" in completions:
        raise ValueError("bad batch")
    return [2.0 for _ in completions]
'''


@pytest.fixture(autouse=True)
def fail_instead_of_hanging():
    """If the time limit were not enforced these tests would hang: fail them after 60 s."""
    def expired(signum, frame):
        raise TimeoutError("the reward time limit was not enforced")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture()
def make_task(tmp_path):
    mod = tmp_path / "user_rewards.py"
    mod.write_text(USER_MODULE)
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"{i} =", "answer": str(i)} for i in range(8)]
    data.write_text("\n".join(json.dumps(r) for r in rows))

    def make(fn, **opts):
        spec = [{"fn": f"{mod}:{f}", "weight": w} for f, w in fn] if isinstance(fn, list) \
            else None
        return build_task("jsonl", train_path=str(data), eval_path=str(data),
                          reward_fn=None if spec else f"{mod}:{fn}", rewards=spec,
                          **{"reward_timeout_s": 2.0, "on_reward_error": "zero", **opts})
    return make


def _score(task, completions):
    exs = task.train_examples()[:len(completions)]
    scorer = RewardScorer(task)
    try:
        return scorer, scorer.score_batch(exs, completions)
    finally:
        scorer.close()


@pytest.mark.parametrize("fn, bad", [("sleepy", "sleep"), ("spin", "spin")])
def test_timeout_scores_zero_counted_and_recovers(make_task, fn, bad):
    task = make_task(fn, reward_timeout_s=1.0)
    exs = task.train_examples()[:4]
    scorer = RewardScorer(task)
    try:
        t0 = time.monotonic()
        out = scorer.score_batch(exs, ["x", bad, "y", "z"])
        took = time.monotonic() - t0
        # the 1 s limit, plus killing and reaping the worker (up to seconds on a busy machine);
        # a limit that did not act would wait for the 3600 s sleep or spin forever
        assert took < 1.0 + 10.0, took
        good = 0.5 if fn == "sleepy" else 0.25
        assert out == [good, 0.0, 0.0, 0.0]      # samples after the stuck one are unscored
        assert scorer.timeouts == 3 and scorer.errors == 0
        # a fresh worker scores the next batch normally
        assert scorer.score_batch(exs[:2], ["a", "b"]) == [good, good]
        assert scorer.metrics()["reward/timeouts"] == 3.0
    finally:
        scorer.close()


def test_timeout_raise_names_the_sample(make_task):
    task = make_task("spin", reward_timeout_s=0.5, on_reward_error="raise")
    exs = task.train_examples()[:3]
    scorer = RewardScorer(task)
    with pytest.raises(RewardError) as err:
        scorer.score_batch(exs, ["a", "spin", "b"])
    msg = str(err.value)
    assert "sample 1 of 3" in msg and "'1 ='" in msg and "'spin'" in msg
    assert "reward_timeout_s=0.5" in msg and "\n" not in msg


def test_exception_scores_zero_and_is_counted(make_task):
    scorer, out = _score(make_task("boom"), ["a", "boom", "c", "boom"])
    assert out == [1.0, 0.0, 1.0, 0.0]
    assert scorer.errors == 2 and scorer.timeouts == 0


def test_exception_raise_names_the_sample(make_task):
    task = make_task("boom", on_reward_error="raise")
    with pytest.raises(RewardError, match=r"sample 2 of 3 \(prompt '2 =', completion 'boom'\): "
                                          r"ZeroDivisionError: user bug"):
        _score(task, ["a", "b", "boom"])


def test_non_finite_reward_is_an_error(make_task):
    scorer, out = _score(make_task("nan"), ["nan", "a"])
    assert out == [0.0, 1.0] and scorer.errors == 1


def test_worker_that_exits_is_an_error_not_a_hang(make_task):
    task = make_task("die")
    exs = task.train_examples()[:3]
    scorer = RewardScorer(task)
    try:
        assert scorer.score_batch(exs, ["a", "die", "b"]) == [1.0, 0.0, 0.0]
        assert scorer.errors == 2
        assert scorer.score_batch(exs[:1], ["a"]) == [1.0]   # restarted
    finally:
        scorer.close()


def test_batched_reward_failure_falls_back_to_naming_the_sample(make_task):
    task = make_task("batch_boom", on_reward_error="raise")
    with pytest.raises(RewardError, match="sample 1 of 3 .*ValueError: bad batch"):
        _score(task, ["a", "boom", "c"])
    scorer, out = _score(make_task("batch_boom"), ["a", "b", "c"])
    assert out == [2.0, 2.0, 2.0] and scorer.errors == 0


def test_components_and_weighted_total(make_task):
    task = make_task([("ok", 1.0), ("sleepy", 2.0)])
    scorer, out = _score(task, ["0", "x", "2"])
    assert out == [1.0 + 2 * 0.5, 0.0 + 2 * 0.5, 1.0 + 2 * 0.5]
    assert scorer.last_components == {"ok": [1.0, 0.0, 1.0], "sleepy": [0.5, 0.5, 0.5]}
    m = scorer.metrics()
    assert m["reward/ok"] == pytest.approx(2 / 3) and m["reward/sleepy"] == 0.5
    assert scorer.metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0}   # reset


def test_per_sample_calls_accumulate_until_metrics(make_task):
    task = make_task([("ok", 1.0), ("boom", 0.5)])
    exs = task.train_examples()
    scorer = RewardScorer(task)
    try:
        values = [scorer(exs[i], c) for i, c in enumerate(["0", "1", "x", "boom"])]
        assert values == [1.5, 1.5, 0.5, 0.0]
        m = scorer.metrics()
        assert m["reward/ok"] == 0.5 and m["reward/boom"] == 0.75 and m["reward/errors"] == 1.0
        assert scorer.seconds > 0 and scorer.state() == {"errors": 1, "timeouts": 0, "calls": 4}
        scorer.load_state({"errors": 5, "timeouts": 2})
        assert (scorer.errors, scorer.timeouts) == (5, 2)
    finally:
        scorer.close()


@pytest.mark.parametrize("timeout", [0, None])
def test_no_limit_scores_in_process(make_task, timeout):
    task = make_task("boom", reward_timeout_s=timeout)
    scorer, out = _score(task, ["a", "boom"])
    assert out == [1.0, 0.0] and scorer.errors == 1
    assert type(scorer._runner).__name__ == "InlineRunner"


def test_builtin_task_through_the_scorer():
    task = build_task("arithmetic", num_eval=4, seed=1, reward_timeout_s=5.0)
    ex = task.eval_examples()
    scorer = RewardScorer(task)
    try:
        answers = [task.answer(e) for e in ex]
        assert scorer.score_batch(ex, answers) == [1.0] * 4
        assert scorer.score_batch(ex, ["x"] * 4) == [0.0] * 4
        assert scorer.correct_batch(ex, answers, [1.0] * 4) == [True] * 4
        assert scorer(ex[0], answers[0]) == 1.0          # per-sample form
    finally:
        scorer.close()


def test_correct_batch_for_data_tasks_uses_the_threshold(make_task):
    task = make_task([("ok", 1.0), ("sleepy", 1.0)], correct_threshold=1.5)
    ex = task.eval_examples()[:2]
    scorer = RewardScorer(task)
    assert scorer.correct_batch(ex, ["0", "x"], [1.5, 0.5]) == [True, False]
    assert task.is_correct(ex[0], "0") and not task.is_correct(ex[1], "x")

