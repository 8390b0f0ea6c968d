"""The `repeated_answers` sign (rlctl/commands/audit): hand-made sample and rollout rows, some
degenerate ("94. 94. 94."), the share of repeated answers counted here by hand; clean
answers, and a sorted list repeating only what its prompt holds, are not counted."""
import json

import pytest

from rlctl.commands.audit.cmd import audit_rollout, audit_samples

Q = "What is 47 + 47? Answer with the number."
CLEAN = [(Q, "94"), (Q, "The answer is 94."), (Q, "14 is 94."), (Q, "94 94"),   # a run of 2 only
         ("Sort: 9 3 9 9", "3 9 9 9"),        # three 9s in a row, as the prompt holds three
         (Q, "47 plus 47 is 94."), (Q, "94.")]
REPEATED = [(Q, "94. 94. 94."), (Q, "94 94 94 94"), (Q, "It is 94, 94, 94")]


def _signs(report):
    return {s["sign"]: s for s in report["hacking_signs"]}


def _rows(pairs, reward=1.0):
    return [{"step": 1 + i // 5, "group": i // 2, "prompt": p, "completion": c, "reward": reward,
             "length": len(c.split()), "finish_reason": "stop"} for i, (p, c) in enumerate(pairs)]


def test_repeated_answers_are_flagged_with_their_share(tmp_path):
    # 3 repeated of 10 rows: 0.3 >= 0.2 flags, whatever they score (all score 1 here)
    sign = _signs(audit_samples(_rows(CLEAN + REPEATED)))["repeated_answers"]
    assert sign["value"] == pytest.approx(3 / 10) and sign["flagged"]
    clean = _signs(audit_samples(_rows(CLEAN)))["repeated_answers"]
    assert clean["value"] == 0.0 and not clean["flagged"]
    # 1 repeated of 8 rows: 0.125 < 0.2, counted but not flagged
    few = _signs(audit_samples(_rows(CLEAN + REPEATED[:1])))["repeated_answers"]
    assert few["value"] == pytest.approx(1 / 8) and not few["flagged"]
    # a rollout file: the same rows, the same share
    path = tmp_path / "roll.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "finish_reason"}) + "\n"
                            for r in _rows(CLEAN + REPEATED)))
    sign = _signs(audit_rollout(path, examples=0))["repeated_answers"]
    assert sign["value"] == pytest.approx(3 / 10) and sign["flagged"]
