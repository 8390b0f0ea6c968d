"""The audit of episodes (rlctl/commands/audit/rows.py) over hand-made
rollout rows and sample rows: each sign's count, share, flag and first example, counted
here by hand from the rows written; the transcript checks find misaligned rows; a
single-turn file gets none of it."""
import json

import pytest

from rlctl.commands.audit.cmd import audit_rollout, audit_samples

M, O = "model", "observation"


def episode(turns, status="done", reward=0.0, tool_calls=0, tool_errors=0, tool_task=True, group=0):
    """A row as `rlctl rollout` writes it; ``turns``: (role, ids, text, truncated)."""
    ids = [i for _, t, _, _ in turns for i in t]
    mask = [int(r == M) for r, t, _, _ in turns for _ in t]
    spans, at = [], 0
    for role, t, text, cut in turns:
        spans.append({"role": role, "start": at, "end": at + len(t), "text": text, "token_ids": t,
                      "logprobs": [-0.5] * len(t) if role == M else [], "reward": 0.0, "truncated": cut})
        at += len(t)
    return {"group": group, "prompt": "1 2 3 * 4 5 =", "completion": " ".join(s[2] for s in turns),
            "token_ids": ids, "mask": mask, "logprobs": [-0.5 * m for m in mask], "length": sum(mask),
            "truncated": status != "done", "reward": reward, "status": status,
            "tool_calls": tool_calls, "tool_errors": tool_errors, "env_errors": 0,
            "obs_truncated": sum(c for *_, c in turns), "tool_task": tool_task, "turns": spans}


CALL = (M, [7, 8, 2], "<call> calc", False)
RESULT = (O, [9, 10], "<result> 5 </result>", False)
CUT = (O, [9, 10], "<result> 5 5 3 5 </result>", True)
ANSWER = (M, [5, 2], "5", False)

TOOL_ROWS = [
    episode([ANSWER]),                                                       # 1: no call
    episode([CALL, RESULT, ANSWER], reward=1.0, tool_calls=1, tool_errors=1),  # 2: error, paid
    episode([CALL, CUT, ANSWER], reward=1.0, tool_calls=1),                  # 3: observation cut
    episode([ANSWER, RESULT, ANSWER], status="turn_limit"),                  # 4: no call, turn limit
    episode([CALL, RESULT, CALL], status="token_limit", tool_calls=2, tool_errors=1),  # 5: error, unpaid
    episode([ANSWER], reward=1.0, group=1),                                  # 6: no call
]


def _write(tmp_path, rows, name="ep.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_episode_signs_count_share_flag_and_first_example(tmp_path):
    rep = audit_rollout(_write(tmp_path, TOOL_ROWS))
    signs = {s["sign"]: s for s in rep["hacking_signs"]}
    expected = {  # sign: (count, share, flagged, first line), counted from the rows above
        "tool_never_called": (3, 3 / 6, True, 1),            # >= 0.5 of the tool task's episodes
        "tool_errors_rewarded": (1, 1 / 6, True, 2),         # any
        "observations_truncated": (1, 1 / 6, True, 3),       # any
        "episodes_at_turn_limit": (1, 1 / 6, False, 4),      # < 0.25
        "episodes_at_token_limit": (1, 1 / 6, False, 5),
    }
    for name, (count, share, flagged, line) in expected.items():
        s = signs[name]
        assert (s["count"], s["flagged"], s["example"]["line"]) == (count, flagged, line), name
        assert s["value"] == pytest.approx(share), name
    assert signs["observations_truncated"]["example"]["turns"] == \
        "model: <call> calc | observation: <result> 5 5 3 5 </result> [truncated] | model: 5"
    assert rep["episodes"] == {"episodes": 6, "status": {"done": 4, "turn_limit": 1, "token_limit": 1},
                               "tool_task_episodes": 6}
    assert rep["truncation_rate"] == pytest.approx(2 / 6)
    assert rep["alignment_ok"] is True and "eos_xor_truncated" not in rep["checks"]


def test_limits_flag_from_a_quarter_and_no_tool_task_is_not_applicable(tmp_path):
    rows = [episode([ANSWER, RESULT, ANSWER], status="turn_limit", tool_task=False),
            episode([ANSWER], reward=1.0, tool_task=False)] * 2
    signs = {s["sign"]: s for s in audit_rollout(_write(tmp_path, rows))["hacking_signs"]}
    assert signs["episodes_at_turn_limit"]["flagged"] and signs["episodes_at_turn_limit"]["value"] == 0.5
    assert signs["tool_never_called"]["value"] is None and not signs["tool_never_called"]["flagged"]
    assert signs["tool_errors_rewarded"]["count"] == 0 and signs["tool_errors_rewarded"]["example"] is None


def test_transcript_checks_find_misaligned_episode_rows(tmp_path):
    good, bad_mask, bad_cover = (episode([CALL, RESULT, ANSWER]) for _ in range(3))
    bad_mask["mask"][3] = 1                 # an observation token counted as the model's
    bad_mask["length"] = sum(bad_mask["mask"])
    bad_cover["token_ids"] = bad_cover["token_ids"][:-1]       # the transcript lost a token
    rep = audit_rollout(_write(tmp_path, [good, bad_mask, bad_cover]))
    checks = rep["checks"]
    assert checks["mask_marks_model_turns"]["lines"] == [2, 3]   # 3: mask longer than token_ids
    assert checks["turns_cover_tokens"]["lines"] == [3]
    assert checks["logprobs_match_tokens"]["lines"] == [3]
    assert checks["length_is_model_tokens"]["violations"] == 0 and rep["alignment_ok"] is False


def test_a_single_turn_file_has_no_episode_checks_or_signs(tmp_path):
    row = {"group": 0, "prompt": "p", "completion": "a", "token_ids": [5, 2], "logprobs": [-1.0, -1.0],
           "length": 2, "ended_with_eos": True, "truncated": False, "max_new_tokens": 4,
           "eos_token_id": 2, "reward": 1.0}
    rep = audit_rollout(_write(tmp_path, [row, {**row, "reward": 0.0}]))
    assert "episodes" not in rep and "turns_cover_tokens" not in rep["checks"]
    assert len(rep["checks"]) == 8
    assert [s["sign"] for s in rep["hacking_signs"]] == [
        "reward_rises_with_length", "truncated_scores_as_well", "top_rewards_at_length_cap",
        "wrong_beats_correct", "repeated_answers", "repetition_rewarded", "format_drift"]


def test_sample_rows_of_episodes_are_audited_with_their_status():
    rows = [{"step": 1, "group": 0, "prompt": r["prompt"], "completion": r["completion"],
             "reward": r["reward"], "length": r["length"], "finish_reason": r["status"],
             **{k: r[k] for k in ("status", "tool_calls", "tool_errors", "obs_truncated", "tool_task")},
             "turns": [{k: t[k] for k in ("role", "text", "reward", "truncated")} for t in r["turns"]]}
            for r in TOOL_ROWS]
    rep = audit_samples(rows)
    assert rep["truncation_rate"] == pytest.approx(2 / 6)          # turn_limit and token_limit
    signs = {s["sign"]: s for s in rep["hacking_signs"]}
    assert signs["tool_errors_rewarded"]["count"] == 1 and signs["tool_errors_rewarded"]["example"]["step"] == 1
    assert signs["tool_never_called"]["count"] == 3
