"""Sample tables (rlctl/train/metrics.py): which rows are drawn, what their columns hold
(checked against the batch they came from, and by hand), that drawing them leaves the
run unchanged, the eval table, and the policy version of asynchronous rollouts."""
import math
import random

import pytest
import torch

from rlctl.train.metrics import draw_rows, sequence_advantages
from rlctl.models.stop_ids import stop_ids

BASE = ["trainer.prompts_per_step=4", "algo.group_size=4", "trainer.eval_every=0", "trainer.lr=1e-3"]
TRAIN_COLUMNS = ["step", "group", "prompt", "completion", "reward/exact", "reward/inclusion_order",
                 "reward/positional", "reward", "advantage", "length", "finish_reason", "stop_id",
                 "stop_token", "policy_version"]


class Recorder:
    """A sink that keeps what it is given (metrics and sample tables)."""

    def __init__(self):
        self.metrics, self.tables = [], []

    def log(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def summary(self, values):
        pass

    def close(self):
        pass

    def samples(self, rows, step, table="train"):
        assert all(list(r) == list(rows[0]) for r in rows)     # one set of keys, one order
        self.tables.append((table, step, [dict(r) for r in rows]))


def _f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def _trainer(make_trainer, overrides):
    tr = make_trainer(BASE + overrides)
    tr.sink = Recorder()
    return tr


def _capture_batches(tr):
    """Record each step's batch as the sample table sees it (after advantages)."""
    seen, prepare = [], tr._prepare

    def spy(batch, prompts):
        out = prepare(batch, prompts)
        seen.append(out)
        return out
    tr._prepare = spy
    return seen


def test_draw_takes_whole_groups_then_the_first_n_rows():
    G, n = 4, 6                      # 6 rows: ceil(6/4) = 2 whole groups, then 6 of their 8 rows
    rows = draw_rows(32, G, n, seed=0, step=5)
    groups = sorted({r // G for r in rows})
    assert len(rows) == n and len(groups) == 2
    assert rows == [groups[0] * G + j for j in range(G)] + [groups[1] * G + j for j in range(2)]
    assert draw_rows(32, G, n, 0, 5) == rows                       # seeded by (seed, step)
    assert len({tuple(draw_rows(32, G, n, 0, s)) for s in range(1, 20)}) > 1   # steps differ
    assert len({tuple(draw_rows(32, G, n, seed, 5)) for seed in range(20)}) > 1
    assert draw_rows(8, G, 100, 0, 1) == list(range(8))           # n > N: every row
    assert len(draw_rows(32, 1, 3, 0, 1)) == 3                    # G = 1: 3 groups of one


def test_draw_leaves_the_global_random_streams_alone():
    torch.manual_seed(3)
    random.seed(3)
    t, p = torch.get_rng_state(), random.getstate()
    draw_rows(64, 8, 8, seed=1, step=25)
    assert torch.equal(torch.get_rng_state(), t) and random.getstate() == p


def test_sequence_advantage_is_the_mean_over_counted_tokens():
    adv = torch.tensor([[1.0, 3.0, 8.0], [0.1, 0.1, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert sequence_advantages(adv, mask) == [2.0, pytest.approx(0.1, abs=1e-8)]
    assert sequence_advantages(torch.tensor([[0.1]]), torch.ones(1, 5))[0] == float(torch.tensor(0.1))


def test_samples_on_or_off_give_the_same_run(make_trainer):
    on = _trainer(make_trainer, ["logger.samples.every=1", "logger.samples.n=5"])   # seeds torch
    a = [on.step(i) for i in (1, 2, 3)]
    off = _trainer(make_trainer, ["logger.samples.every=0"])
    b = [off.step(i) for i in (1, 2, 3)]
    for x, y in zip(a, b):
        keys = [k for k in x if not k.startswith(("time/", "perf/"))]
        assert keys == [k for k in y if not k.startswith(("time/", "perf/"))]
        assert {k: (x[k], y[k]) for k in keys if x[k] != y[k]} == {}       # exactly equal
    assert {k for k in a[0] if a[0][k] != a[2][k] and not k.startswith(("time/", "perf/"))}  # can fail
    assert [(t, s, len(r)) for t, s, r in on.sink.tables] == [("train", s, 5) for s in (1, 2, 3)]
    assert off.sink.tables == []


def test_columns_hold_the_rows_of_the_batch(make_trainer):
    """GRPO on sorting (reward=positional): each value against the batch it came from, and
    the advantages recomputed by hand from the table's own whole group."""
    tr = _trainer(make_trainer, ["logger.samples.every=2", "logger.samples.n=6", "trainer.steps=3"])
    batches = _capture_batches(tr)
    for i in (1, 2, 3):
        tr.step(i)
    assert [s for _, s, _ in tr.sink.tables] == [2, 3]            # every 2 steps, and the last
    stops = set(stop_ids(tr.policy, tr.tokenizer))
    for (table, step, rows), batch in zip(tr.sink.tables, batches[1:]):
        assert table == "train" and [list(r) for r in rows] == [TRAIN_COLUMNS] * 6
        picked = draw_rows(batch.num_sequences, 4, 6, seed=0, step=step)
        for r, i in zip(rows, picked):
            L = int(batch.mask[i].sum())
            assert r["step"] == step and r["policy_version"] == step - 1
            assert r["group"] == i // 4 and r["prompt"] == batch.prompts[i]
            assert r["completion"] == batch.completions[i]            # the text the scorer saw
            assert r["reward"] == float(batch.rewards[i]) == _f32(r["reward/positional"])   # weight 1
            assert r["reward/exact"] == float(r["completion"].split() == sorted(r["prompt"].split()[:-1]))
            assert r["advantage"] == float(batch.advantages[i, 0])
            assert r["length"] == L
            ended = int(batch.completion_ids[i, L - 1])
            if bool(batch.truncated[i]):
                assert (r["finish_reason"], r["stop_id"], r["stop_token"]) == ("length", None, None)
                assert L == batch.mask.shape[1]
            else:
                assert r["finish_reason"] == "stop" and r["stop_id"] == ended and ended in stops
                assert r["stop_token"] == tr.tokenizer.convert_ids_to_tokens(ended)
        group = [r["reward"] for r in rows[:4]]                       # the first whole group
        mean = sum(group) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / 3)
        want = [0.0] * 4 if std == 0 else [(x - mean) / (std + 1e-6) for x in group]
        assert [r["advantage"] for r in rows[:4]] == pytest.approx(want, abs=1e-5)
        assert len({r["group"] for r in rows}) == 2


def test_gae_advantage_is_the_mean_over_counted_tokens(make_trainer):
    from rlctl.models.value import PolicyValueModel
    tr = make_trainer(BASE + ["algo=ppo", "logger.samples.every=1", "logger.samples.n=4"],
                      wrap=lambda model: PolicyValueModel(model, init_std=0.05))
    tr.sink = Recorder()
    batches = _capture_batches(tr)
    tr.step(1)
    (_, _, rows), batch = tr.sink.tables[0], batches[0]
    for r, i in zip(rows, draw_rows(batch.num_sequences, batch.group_size, 4, 0, 1)):
        m = batch.mask[i].double()
        assert r["advantage"] == pytest.approx(float((batch.advantages[i].double() * m).sum() / m.sum()),
                                               rel=1e-12)
    assert len({r["advantage"] for r in rows}) > 1


def test_eval_table_holds_the_first_eval_examples(make_trainer):
    tr = _trainer(make_trainer, ["logger.samples.every=5", "logger.samples.n=3", "task.num_eval=8"])
    metrics = tr._evaluate(7)
    [(table, step, rows)] = tr.sink.tables
    assert (table, step, len(rows)) == ("eval", 7, 3)
    assert list(rows[0]) == ["step", "prompt", "completion", "reward", "exact_match", "length",
                             "finish_reason", "stop_id", "stop_token", "policy_version"]
    for r, ex in zip(rows, tr.eval_examples[:3]):
        assert r["prompt"] == ex.prompt and r["step"] == 7 and r["policy_version"] == 7
        assert r["reward"] == tr.eval_scorer(ex, r["completion"])
        assert r["exact_match"] == float(tr.task.is_correct(ex, r["completion"]))
        assert 1 <= r["length"] <= 8 and r["finish_reason"] in ("stop", "length")
    assert 0 <= metrics["eval/exact_match"] <= 1
    off = _trainer(make_trainer, ["logger.samples.every=0", "task.num_eval=8"])
    assert off._evaluate(7) == metrics and off.sink.tables == []   # same eval, no table


def test_async_rows_carry_the_policy_version_and_named_rewards(make_trainer):
    """max_staleness=1: rollouts are [0, 1, 1] updates old (test_engine_async), so the
    weights that sampled steps 1, 2, 3 had 0, 0, 1 updates. All 16 rows are drawn: their
    named rewards (sent per row by the actor) average to the step's reward/<name>."""
    tr = _trainer(make_trainer, ["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=1",
                                 "logger.samples.every=1", "logger.samples.n=16"])
    steps = [tr.step(i) for i in (1, 2, 3)]
    assert [s["async/staleness"] for s in steps] == [0, 1, 1]
    assert [{r["policy_version"] for r in rows} for _, _, rows in tr.sink.tables] == [{0}, {0}, {1}]
    for (_, _, rows), values in zip(tr.sink.tables, steps):
        assert list(rows[0]) == TRAIN_COLUMNS and len(rows) == 16
        for name in ("exact", "positional", "inclusion_order"):
            assert sum(r[f"reward/{name}"] for r in rows) / 16 == pytest.approx(values[f"reward/{name}"],
                                                                                 abs=1e-12)
        assert sum(r["reward"] for r in rows) / 16 == pytest.approx(values["reward/mean"], abs=1e-6)
        assert all(isinstance(r["completion"], str) for r in rows)
        assert any(r["completion"] for r in rows)                     # decoded on the learner


def test_batches_carry_named_rewards_and_staleness_through_select_and_concat():
    from rlctl.types import LogProbs, RolloutBatch

    def batch(n, parts, stale):
        return RolloutBatch(input_ids=torch.zeros(n, 3, dtype=torch.long), attention_mask=torch.ones(n, 3),
                            mask=torch.ones(n, 1), truncated=torch.zeros(n, dtype=torch.bool),
                            rewards=torch.zeros(n), group_ids=torch.arange(n) // 2, prompt_len=2,
                            group_size=2, prompts=["p"] * n, completions=["c"] * n,
                            logprobs=LogProbs(staleness=torch.full((n,), stale)), reward_parts=parts)
    a = batch(2, {"x": [1.0, 2.0]}, 0)
    b = batch(4, {"x": [3.0, 4.0, 5.0, 6.0], "y": [7.0, 8.0, 9.0, 10.0]}, 1)
    out = RolloutBatch.concat([a, b], pad_id=0)
    assert out.reward_parts == {"x": [1, 2, 3, 4, 5, 6], "y": [0, 0, 7, 8, 9, 10]}   # a lacks y: 0
    assert out.logprobs.staleness.tolist() == [0, 0, 1, 1, 1, 1]
    picked = out.select(torch.tensor([5, 0]))
    assert picked.reward_parts == {"x": [6, 1], "y": [10, 0]} and picked.logprobs.staleness.tolist() == [1, 0]
    assert out.select(torch.tensor([0]), text=False).reward_parts == {"x": [], "y": []}
    none = RolloutBatch.concat([a.replace(reward_parts=None, logprobs=dict(staleness=None)), b], pad_id=0)
    assert none.reward_parts is None and none.logprobs.staleness is None      # set in some batches only
    assert a.replace(reward_parts=None).select(torch.tensor([1])).reward_parts is None
