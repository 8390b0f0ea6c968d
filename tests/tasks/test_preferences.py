"""task=preferences: the pairs file as `rlctl reward-model train` reads it, chat messages,
the held-out split, and a generation's score (the chosen answer, or the task's reward)."""
import json

import pytest

from rlctl.errors import DataError
from rlctl.tasks.preference import PreferenceTask, read_pairs
from rlctl.tasks.task import RAW_PROMPT, build_task


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_pairs_keep_the_messages_and_take_the_answer_s_last_message(tmp_path):
    prompt = [{"role": "system", "content": "sort"}, {"role": "user", "content": "2 1"}]
    rows = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "1 2"}],
             "rejected": "2 1"}] * 4
    path = _write(tmp_path / "p.jsonl", rows)
    (pair,) = read_pairs(path, "X", messages=True)[:1]
    assert pair.prompt == prompt and pair.chosen == "1 2" and pair.rejected == "2 1"
    with pytest.raises(DataError, match="'prompt' must be text, got list"):
        read_pairs(path, "PREFS")                  # the reward model reads text only
    with pytest.raises(DataError, match="the prompt field 'prompt' holds chat messages; set "
                                        "task.prompt_format=chat"):
        build_task("preferences", train_path=path, eval_frac=0.25, seed=0).train_examples()
    task = build_task("preferences", train_path=path, eval_frac=0.25, seed=0, prompt_format="chat")
    train, held = task.train_examples(), task.eval_examples()
    assert (len(train), len(held)) == (3, 1)
    assert held[0].fields[RAW_PROMPT] == prompt and held[0].prompt == "2 1"
    assert task.reward(held[0], " 1 2 ") == 1.0 and not task.is_correct(held[0], "2 1")


def test_pairs_from_sorting_score_generations_by_the_sorting_task():
    task = PreferenceTask(pairs_from="sorting", num_pairs=8, num_eval=4, seed=1)
    ex = task.eval_examples()[0]
    digits = ex.fields["digits"]
    assert ex.fields["chosen"] == " ".join(map(str, sorted(digits))) != ex.fields["rejected"]
    assert task.is_correct(ex, ex.fields["chosen"]) and not task.is_correct(ex, ex.fields["rejected"])
    assert len(task.train_examples()) == 8 and len(task.eval_examples()) == 4
    with pytest.raises(DataError, match="makes no preference pairs"):
        PreferenceTask(pairs_from="arithmetic")
