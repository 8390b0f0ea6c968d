"""RolloutBatch operations written once over its fields, and the renamed trainer.async key."""
import subprocess
import sys

import torch

from rlctl.config.compose import rename_deprecated
from rlctl.types import Episode, EpisodePart, LogProbs, RolloutBatch


def _batch(n, P, T, g0=0, pad=0):
    """n rows, prompt P, completion T; values that tell rows and columns apart."""
    ids = torch.arange(n * (P + T)).view(n, P + T) + 100
    return RolloutBatch(
        input_ids=ids, attention_mask=torch.ones(n, P + T, dtype=torch.long),
        mask=torch.ones(n, T), truncated=torch.zeros(n, dtype=torch.bool),
        rewards=torch.arange(n).float(), group_ids=torch.arange(n) // 2 + g0, prompt_len=P,
        group_size=2, prompts=[f"p{i}" for i in range(n)], completions=[f"c{i}" for i in range(n)],
        advantages=torch.full((n, T), 2.0))


def test_concat_pads_prompts_left_and_completions_right():
    a, b = _batch(2, 3, 2), _batch(2, 1, 4)
    out = RolloutBatch.concat([a, b], pad_id=7)
    assert out.prompt_len == 3 and out.input_ids.shape == (4, 7)
    # a: prompt already 3 wide, completion 2 -> 2 pad columns on the right
    assert out.input_ids[0].tolist() == a.input_ids[0].tolist() + [7, 7]
    # b: prompt 1 -> 2 pad columns on the left, completion already 4 wide
    assert out.input_ids[2].tolist() == [7, 7] + b.input_ids[0].tolist()
    assert out.attention_mask[2].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert out.mask[:2].tolist() == [[1, 1, 0, 0]] * 2 and out.advantages[0].tolist() == [2, 2, 0, 0]
    assert out.group_ids.tolist() == [0, 0, 1, 1]          # renumbered: groups stay distinct
    assert out.prompts == ["p0", "p1", "p0", "p1"] and out.logprobs.old is None


def test_select_cut_and_replace_touch_every_field():
    b = _batch(4, 2, 3)
    s = b.select(torch.tensor([3, 1]))
    assert s.rewards.tolist() == [3.0, 1.0] and s.completions == ["c3", "c1"]
    assert torch.equal(s.input_ids, b.input_ids[[3, 1]])
    assert b.select(torch.tensor([0]), text=False).prompts == []
    c = b.cut(1)
    assert c.input_ids.shape == (4, 3) and c.mask.shape == (4, 1) and c.advantages.shape == (4, 1)
    r = b.replace(rewards=torch.zeros(4))
    assert r.rewards.sum() == 0 and b.rewards.sum() == 6 and r.input_ids is b.input_ids


def test_the_parts_go_through_select_cut_concat_to_and_replace():
    """Every per-row tensor and list inside ``logprobs`` and ``episodes`` is indexed, cut,
    stacked and moved as the top-level fields are; a dict in ``replace`` changes only its keys."""
    def with_parts(n, P, T, base):
        lp = LogProbs(old=torch.full((n, T), -1.0) - torch.arange(n)[:, None], engine=torch.zeros(n, T),
                      ref=torch.full((n, T), -2.0), staleness=torch.arange(n) + base)
        return _batch(n, P, T).replace(logprobs=lp, episodes=EpisodePart(
            [Episode(status=f"e{base + i}") for i in range(n)], torch.arange(n * T).view(n, T) + 10.0 * base))
    b = with_parts(4, 2, 3, 0)
    s = b.select(torch.tensor([3, 1]))
    assert s.logprobs.old[:, 0].tolist() == [-4.0, -2.0] and s.logprobs.staleness.tolist() == [3, 1]
    assert [e.status for e in s.episodes.records] == ["e3", "e1"]
    assert torch.equal(s.episodes.token_rewards, b.episodes.token_rewards[[3, 1]])
    assert b.select(torch.tensor([0]), text=False).episodes.records == []
    c = b.cut(1)
    assert c.logprobs.old.shape == c.logprobs.ref.shape == c.episodes.token_rewards.shape == (4, 1)
    assert c.logprobs.staleness.shape == (4,) and len(c.episodes.records) == 4
    out = RolloutBatch.concat([with_parts(2, 1, 2, 0), with_parts(2, 2, 3, 5)], pad_id=0)
    assert out.logprobs.staleness.tolist() == [0, 1, 5, 6] and out.logprobs.ref.shape == (4, 3)
    assert [e.status for e in out.episodes.records] == ["e0", "e1", "e5", "e6"]
    assert out.episodes.token_rewards[1].tolist() == [2.0, 3.0, 0.0]
    assert RolloutBatch.concat([b, _batch(2, 2, 3)], pad_id=0).episodes is None   # one lacks them
    r = b.replace(logprobs=dict(ref=None), episodes=dict(token_rewards=torch.zeros(4, 3)))
    assert r.logprobs.ref is None and r.logprobs.old is b.logprobs.old and b.logprobs.ref is not None
    assert r.episodes.records is b.episodes.records and r.episodes.token_rewards.sum() == 0
    moved = b.to("meta")
    assert moved.logprobs.old.is_meta and moved.episodes.token_rewards.is_meta and moved.mask.is_meta
    assert moved.episodes.records is b.episodes.records


def test_old_async_key_is_renamed_with_one_notice(tmp_path):
    out, recipe = rename_deprecated(["trainer.async.enabled=true", "+trainer.async.num_actors=2", "seed=1"],
                                    {"trainer": {"async": {"max_staleness": 0}}},
                                    stream=(tmp_path / "err").open("w"))
    assert out == ["trainer.async_rollout.enabled=true", "+trainer.async_rollout.num_actors=2", "seed=1"]
    assert recipe == {"trainer": {"async_rollout": {"max_staleness": 0}}}
    proc = subprocess.run([sys.executable, "-m", "rlctl.cli", "train", "--dry-run", "trainer.async.enabled=true"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notices = [line for line in proc.stderr.splitlines() if "deprecated" in line]
    assert notices == ["rlctl: warning: trainer.async is deprecated, renamed trainer.async_rollout "
                       "(e.g. trainer.async_rollout.enabled=true)"]
    assert "Traceback" not in proc.stderr


def test_concat_keeps_old_logprobs_and_behaviour_rows_as_a_pair():
    """behaviour_rows None means logprobs.old holds in every row. A mixed batch (rows
    [real, placeholder]) stacked with a fully valid one must mark exactly the one
    placeholder row; a batch without old log-probs contributes 0-filled placeholder rows."""
    mixed, valid, none = _batch(2, 2, 2), _batch(2, 2, 3), _batch(2, 1, 2)
    mixed = mixed.replace(logprobs=LogProbs(old=torch.tensor([[-1.0, -2.0], [0.0, 0.0]]),
                                            behaviour_rows=torch.tensor([True, False])))
    valid = valid.replace(logprobs=LogProbs(old=torch.full((2, 3), -3.0)))
    out = RolloutBatch.concat([mixed, valid], pad_id=0)
    assert out.logprobs.behaviour_rows.tolist() == [True, False, True, True]
    assert out.logprobs.old.tolist() == [[-1, -2, 0], [0, 0, 0], [-3, -3, -3], [-3, -3, -3]]
    out = RolloutBatch.concat([valid, none], pad_id=0)
    assert out.logprobs.behaviour_rows.tolist() == [True, True, False, False]
    assert out.logprobs.old[2:].abs().sum() == 0 and out.logprobs.old.shape == (4, 3)
    both = RolloutBatch.concat([valid, valid], pad_id=0)
    assert both.logprobs.behaviour_rows is None and both.logprobs.old.shape == (4, 3)
    assert RolloutBatch.concat([none, none], pad_id=0).logprobs.old is None


def test_rename_notice_is_printed_once_per_process(monkeypatch):
    import io

    import rlctl.config.compose as overrides
    monkeypatch.setattr(overrides, "_TOLD_RENAMES", set())
    err = io.StringIO()
    for _ in range(3):      # a sweep composes every cell with the same overrides
        rename_deprecated(["trainer.async.enabled=false"], {"trainer": {"async": {}}}, stream=err)
    assert err.getvalue().count("deprecated") == 1
