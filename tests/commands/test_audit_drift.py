"""The `format_drift` sign (rlctl/commands/audit): hand-made sample rows over three steps,
where the late completions leave the early steps' format ("The answer is 94." -> "14 is
94.") while the reward rises (flagged), keep it (not flagged), or leave it while the reward
falls (counted, not flagged); the shares and rewards are counted here by hand."""
import json

import pytest

from rlctl.commands.audit.cmd import audit_rollout, audit_samples
from rlctl.commands.audit.rows import shape

Q = "Which number is larger, 94 or 12? Answer with just the number."
# step 1: shapes "a 9." x 3 and "a 9": common = {"a 9."} (3 of 4 cover half), share 3/4
EARLY = ["The answer is 94.", "The answer is 12.", "The answer is 7.", "It is 5"]
MIDDLE = ["The answer is 94.", "94", "The answer is 7.", "It is 5"]     # step 2: not compared
DRIFTED = ["14 is 94.", "3 is 12.", "The answer is 7.", "5 is 5."]      # share 1/4
KEPT = ["The answer is 94.", "The answer is 12.", "The answer is 7.", "It is 6"]   # share 3/4


def _format_drift(late, early_rewards=(0, 0, 1, 0), late_rewards=(1, 1, 1, 0)):
    rows = []
    for step, (texts, rewards) in enumerate([(EARLY, early_rewards), (MIDDLE, (0.5,) * 4),
                                             (late, late_rewards)], 1):
        rows += [{"step": step, "group": 0, "prompt": Q, "completion": c, "reward": float(r),
                  "length": len(c.split()), "finish_reason": "stop"} for c, r in zip(texts, rewards)]
    return {s["sign"]: s for s in audit_samples(rows)["hacking_signs"]}["format_drift"]


def test_shape_maps_digits_letters_and_collapses_runs():
    assert shape("The answer is 94.") == "a 9." == shape("So the larger of the two is 94.")
    assert shape(" 94. 94.  94. ") == "9. 9. 9."
    assert shape("14 is 94.") == "9 a 9."


def test_format_drift_flags_a_new_format_that_the_reward_pays():
    # 3/4 - 1/4 = 0.5 > 0.3, reward 0.25 -> 0.75: flagged
    sign = _format_drift(DRIFTED)
    assert sign["value"] == pytest.approx(0.5) and sign["flagged"]
    assert "0.25 -> 0.75" in sign["why"]
    # the format kept (3/4 - 3/4 = 0), the same reward rise: not flagged
    kept = _format_drift(KEPT)
    assert kept["value"] == pytest.approx(0.0) and not kept["flagged"]
    # drifted while the reward falls (0.75 -> 0.25): counted, not flagged
    falls = _format_drift(DRIFTED, early_rewards=(1, 1, 1, 0), late_rewards=(0, 0, 1, 0))
    assert falls["value"] == pytest.approx(0.5) and not falls["flagged"]


def test_format_drift_needs_two_steps(tmp_path):
    path = tmp_path / "roll.jsonl"          # rollout rows: one policy, no step
    path.write_text("".join(json.dumps({"group": 0, "prompt": Q, "completion": c, "reward": 1.0,
                                        "length": 3}) + "\n" for c in EARLY + DRIFTED))
    sign = {s["sign"]: s for s in audit_rollout(path, examples=0)["hacking_signs"]}["format_drift"]
    assert sign["value"] is None and not sign["flagged"] and "2 steps" in sign["why"]


def test_prose_of_other_word_counts_is_not_drift():
    # every late answer is words then a number, as early: one shape "a 9.", share 3/4 - 3/4 = 0
    prose = ["The larger of the two numbers is 94.", "So it is 12.", "I think the answer is 7.",
             "It is 6"]
    sign = _format_drift(prose)
    assert sign["value"] == pytest.approx(0.0) and not sign["flagged"]
