"""Sorting task: prompts, splits and the three reward designs (expected values by hand).

Prompt digits [3, 1, 4, 1, 5]: target [1, 1, 3, 4, 5], n = 5, inclusion_order divides
by 2n - 1 = 9; the prompt's digit set is {1, 3, 4, 5}.
"""
import pytest
from hypothesis import given, settings, strategies as st

from rlctl.tasks import TASKS, build_task
from rlctl.tasks.sorting import SortingTask, parse_digits, reward_names, score_all

EX = SortingTask._example([3, 1, 4, 1, 5])
DIGITS = [3, 1, 4, 1, 5]

# completion -> (exact, positional, inclusion_order)
CASES = {
    "1 1 3 4 5": (1.0, 1.0, 9 / 9),
    "  1  1 3\t4 5\n": (1.0, 1.0, 9 / 9),           # any whitespace separates
    "3 1 4 1 5": (0.0, 2 / 5, (5 + 2) / 9),          # copy: matches at i=1, i=4
    "1 1 3 4": (0.0, 4 / 5, (4 + 3) / 9),            # too short
    "1 1 3 4 5 5": (0.0, 5 / 6, (6 + 5) / 9),        # over-long: positional penalised
    "1 1 1 1 1 1 1 1 1 1": (0.0, 2 / 10, (10 + 9) / 9),  # hack: inclusion_order > 1
    "9 8 7 6 2": (0.0, 0.0, 0.0),                    # none in prompt, all descending
    "0 1 2 3 4": (0.0, 1 / 5, (3 + 4) / 9),          # 1, 3, 4 in prompt; 4 ordered pairs
    "5": (0.0, 0.0, 1 / 9),
    "1": (0.0, 1 / 5, 1 / 9),
    "": (0.0, 0.0, 0.0),
    "   \n": (0.0, 0.0, 0.0),
}
MALFORMED = ["1 1 3 4 5 =", "1,1,3,4,5", "11 3 4 5", "1 1 3 4 x", "-1 1 3 4 5",
             "\u0661 1 3 4 5", "<eos>", "1 1 3 4 5 10", "1 1 3 4 5 <pad>", "½", "1.0 1 3 4 5"]


@pytest.mark.parametrize("completion", list(CASES))
@pytest.mark.parametrize("k, name", list(enumerate(["exact", "positional", "inclusion_order"])))
def test_rewards_by_hand(completion, k, name):
    task = SortingTask(num_eval=4, reward=name)
    assert task.reward(EX, completion) == pytest.approx(CASES[completion][k])
    assert score_all(DIGITS, completion)[name] == pytest.approx(CASES[completion][k])


@pytest.mark.parametrize("completion", MALFORMED + [None, 5])
def test_malformed_scores_zero_everywhere(completion):
    assert parse_digits(completion) is None
    assert score_all(DIGITS, completion) == {n: 0.0 for n in reward_names()}
    assert not SortingTask(num_eval=4).is_correct(EX, completion)


def test_is_correct_is_exact_whatever_the_reward():
    task = SortingTask(num_eval=4, reward="inclusion_order")
    assert task.is_correct(EX, "1 1 3 4 5")
    assert not task.is_correct(EX, "1 1 1 1 1 1 1 1 1 1")
    assert task.reward(EX, "1 1 1 1 1 1 1 1 1 1") > 1.0  # the naive design pays for repetition


def test_well_formed():
    task = SortingTask(num_eval=4)
    assert task.is_well_formed(EX, "9 9 9 9 9")
    assert not task.is_well_formed(EX, "9 9 9 9")
    assert not task.is_well_formed(EX, "9 9 9 9 9 =")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40), st.lists(st.integers(0, 9), min_size=1, max_size=8))
def test_rewards_never_raise_and_stay_in_range(text, digits):
    scores = score_all(digits, text)
    assert set(scores) == set(reward_names())
    assert 0.0 <= scores["exact"] <= 1.0 and 0.0 <= scores["positional"] <= 1.0
    assert scores["inclusion_order"] >= 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8))
def test_sorted_answer_gets_full_credit(digits):
    answer = " ".join(map(str, sorted(digits)))
    assert score_all(digits, answer) == {n: pytest.approx(1.0) for n in reward_names()}


def test_unknown_reward_names_valid_choices():
    with pytest.raises(ValueError, match="exact, positional, inclusion_order"):
        SortingTask(reward="bogus")
    assert reward_names() == ("exact", "positional", "inclusion_order")


def test_prompt_and_fields():
    task = SortingTask()
    ex = task.eval_examples()[0]
    assert ex.prompt == " ".join(map(str, ex.fields["digits"])) + " ="
    assert ex.fields["target"] == sorted(ex.fields["digits"])
    assert len(ex.fields["digits"]) == 5
    assert EX.prompt == "3 1 4 1 5 =" and SortingTask.answer(EX) == "1 1 3 4 5"


def test_registry():
    assert "sorting" in TASKS
    task = build_task("sorting", num_digits=3, reward="exact", num_eval=8, seed=7)
    assert isinstance(task, SortingTask) and task.num_digits == 3
    assert task.reward(task.eval_examples()[0], "") == 0.0


def _tuples(examples):
    return [tuple(e.fields["digits"]) for e in examples]


def test_splits_disjoint_distinct_deterministic():
    a, b = SortingTask(), SortingTask()
    ev, tr = _tuples(a.eval_examples()), _tuples(a.train_examples())
    assert len(ev) == 256 and len(set(ev)) == 256
    assert len(tr) == 20000 and len(set(tr)) == 20000
    assert not set(ev) & set(tr)
    assert ev == _tuples(b.eval_examples()) and tr == _tuples(b.train_examples())
    assert set(ev) != set(_tuples(SortingTask(seed=1).eval_examples()))


def test_small_space_train_is_the_complement():
    task = SortingTask(num_digits=2, num_eval=10)
    ev, tr = set(_tuples(task.eval_examples())), _tuples(task.train_examples())
    assert len(ev) == 10 and len(tr) == 90
    assert ev | set(tr) == {(i, j) for i in range(10) for j in range(10)}


def test_num_eval_must_leave_room():
    with pytest.raises(ValueError):
        SortingTask(num_digits=1, num_eval=10)


@pytest.mark.parametrize("name", ["exact", "positional", "inclusion_order"])
def test_every_design_is_logged_and_the_training_one_is_the_total(name):
    """Through the RewardScorer (the path reward/<name> metrics take): each step logs all
    three designs, and the total that trains (reward/mean) is the chosen one alone. The
    expected means are the hand-worked CASES above."""
    from rlctl.tasks.scoring import RewardScorer

    task = SortingTask(num_eval=4, reward=name)
    completions = list(CASES)
    with RewardScorer(task, timeout_s=0) as scorer:
        totals = scorer.score_batch([EX] * len(completions), completions)
        metrics = scorer.metrics()
    k = ["exact", "positional", "inclusion_order"].index(name)
    assert totals == pytest.approx([CASES[c][k] for c in completions])
    for j, design in enumerate(["exact", "positional", "inclusion_order"]):
        want = sum(CASES[c][j] for c in completions) / len(completions)
        assert metrics[f"reward/{design}"] == pytest.approx(want)


def test_reward_hacking_recipe_logs_every_design(tmp_path, rlctl_app):
    """`rlctl train --recipe reward-hacking` (a short run, the CLI app in-process): trains
    on inclusion_order, so reward/mean equals reward/inclusion_order each step, and the
    other designs are there."""
    import json

    out = rlctl_app("train", "--recipe", "reward-hacking", "trainer.steps=2",
                    "trainer.eval_every=2", "task.num_eval=16", "trainer.prompts_per_step=2",
                    "algo.group_size=4", "logger=jsonl", "run.save_model=false",
                    f"run.output_dir={tmp_path}")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if r.get("step", 0) > 0 and "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert {"reward/exact", "reward/positional", "reward/inclusion_order"} <= set(r)
        # reward/mean goes through a float32 tensor: |value| < 3, so rounding < 3e-7
        assert r["reward/mean"] == pytest.approx(r["reward/inclusion_order"], abs=1e-6)
        assert r["reward/exact"] <= r["reward/positional"] + 1e-9   # exact 1 => positional 1
