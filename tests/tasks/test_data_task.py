"""task=jsonl: loading JSONL/JSON/CSV/TSV/Parquet/datasets directories, fields handed to
the reward, reward functions by import path, several weighted rewards, option errors."""
import csv
import json
import sys

import pytest

from rlctl.tasks import build_task
from rlctl.tasks.data import load_records
from rlctl.tasks.rewards import load_function, parse_rewards

ROWS = [{"prompt": f"{i} + {i} =", "answer": str(2 * i), "level": i % 3} for i in range(10)]

REWARDS = '''
def correct(prompt, completion, answer, **fields):
    return 1.0 if completion.strip() == answer else 0.0

def length(prompt, completion):
    return -0.1 * len(completion)

def only_level(prompt, completion, level):
    return float(level)

def needs_missing(prompt, completion, missing):
    return 0.0

def echo(prompt, completion, **fields):
    return float(len(prompt)) + float(len(fields))

def batched(prompts, completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]

def not_a_reward(x):
    return 0.0
'''


@pytest.fixture()
def user_mod(tmp_path, monkeypatch):
    (tmp_path / "byo_rewards_t.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "byo_rewards_t"
    sys.modules.pop("byo_rewards_t", None)


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _csv(path, rows, delimiter=","):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
        w.writeheader()
        w.writerows(rows)
    return str(path)


# ---- loading ----------------------------------------------------------------------------
def test_jsonl_json_csv_tsv_load_the_same_rows(tmp_path):
    as_text = [{k: str(v) for k, v in r.items()} for r in ROWS]
    assert load_records(_jsonl(tmp_path / "a.jsonl", ROWS)) == ROWS
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    assert load_records(tmp_path / "a.json") == ROWS
    assert load_records(_csv(tmp_path / "a.csv", ROWS)) == as_text       # CSV: all strings
    assert load_records(_csv(tmp_path / "a.tsv", ROWS, "\t")) == as_text
    assert load_records(_csv(tmp_path / "a.txt", ROWS), fmt="csv") == as_text


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (pip install pyarrow)")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    assert load_records(tmp_path / "a.parquet") == ROWS


def test_hf_datasets_directory(tmp_path):
    """A directory written by datasets' save_to_disk (by datasets itself when installed,
    else the same layout with pyarrow: state.json + Arrow stream shards)."""
    pa = pytest.importorskip("pyarrow", reason="datasets directories need pyarrow")
    d = tmp_path / "ds"
    try:
        import datasets
        datasets.Dataset.from_list(ROWS).save_to_disk(str(d))
        datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)).save_to_disk(str(tmp_path / "dd"))
    except ImportError:
        d.mkdir()
        table = pa.Table.from_pylist(ROWS)
        with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
        (d / "state.json").write_text(json.dumps({"_data_files": [
            {"filename": "data-00000-of-00001.arrow"}]}))
        (tmp_path / "dd").mkdir()
        (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert load_records(d) == ROWS
    with pytest.raises(ValueError, match="holds the splits train; point it at one of them"):
        load_records(tmp_path / "dd")


def test_directory_of_data_files(tmp_path):
    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "train-0.jsonl", ROWS[:4])
    _jsonl(tmp_path / "data" / "train-1.jsonl", ROWS[4:])
    assert load_records(tmp_path / "data") == ROWS


@pytest.mark.parametrize("name, content, fmt, msg", [
    ("x.jsonl", '{"prompt": "a"}\n{"prompt": \n', "auto", r"x.jsonl:2: invalid JSON"),
    ("x.jsonl", '["a"]\n', "auto", r"x.jsonl:1: each line must be a JSON object"),
    ("x.jsonl", "", "auto", r"has no rows"),
    ("x.data", "a,b\n", "auto", r"cannot tell the format of .*set task.format"),
    ("x.jsonl", "{}", "yaml", r"invalid task.format 'yaml'; valid: auto, jsonl"),
    ("x.parquet", "not parquet", "auto", r"cannot read .* as parquet"),
])
def test_bad_files_fail_in_one_line(tmp_path, name, content, fmt, msg):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=msg) as err:
        load_records(tmp_path / name, fmt)
    assert "\n" not in str(err.value)


def test_missing_file_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"task.eval_path: no such file or directory"):
        load_records(tmp_path / "nope.jsonl", key="task.eval_path")


# ---- the task ---------------------------------------------------------------------------
def _task(tmp_path, user_mod, **kw):
    kw.setdefault("train_path", _jsonl(tmp_path / "train.jsonl", ROWS))
    if "eval_path" not in kw and "num_eval" not in kw:
        kw["eval_path"] = _jsonl(tmp_path / "eval.jsonl", ROWS[:2])
    if "rewards" not in kw:
        kw.setdefault("reward_fn", f"{user_mod}:correct")
    return build_task("jsonl", **kw)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_task_from_each_format(tmp_path, user_mod, fmt):
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (pip install pyarrow)")
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(ROWS[:7]), tmp_path / "t.parquet")
        pq.write_table(pa.Table.from_pylist(ROWS[7:]), tmp_path / "e.parquet")
        train, ev = tmp_path / "t.parquet", tmp_path / "e.parquet"
    elif fmt == "csv":
        train, ev = _csv(tmp_path / "t.csv", ROWS[:7]), _csv(tmp_path / "e.csv", ROWS[7:])
    else:
        train, ev = _jsonl(tmp_path / "t.jsonl", ROWS[:7]), _jsonl(tmp_path / "e.jsonl", ROWS[7:])
    task = _task(tmp_path, user_mod, train_path=str(train), eval_path=str(ev))
    assert [e.prompt for e in task.train_examples()] == [r["prompt"] for r in ROWS[:7]]
    ex = task.eval_examples()[0]
    assert ex.prompt == "7 + 7 =" and ex.fields["answer"] == "14"
    assert task.reward(ex, " 14 ") == 1.0 and task.reward(ex, "15") == 0.0
    assert task.is_correct(ex, "14") and not task.is_correct(ex, "1 4")


def test_holdout_without_eval_path_is_disjoint_and_seeded(tmp_path, user_mod):
    a = _task(tmp_path, user_mod, num_eval=3, seed=1)
    b = _task(tmp_path, user_mod, num_eval=3, seed=1)
    c = _task(tmp_path, user_mod, num_eval=3, seed=2)
    tr, ev = {e.prompt for e in a.train_examples()}, {e.prompt for e in a.eval_examples()}
    assert len(ev) == 3 and len(tr) == 7 and not tr & ev
    assert ev == {e.prompt for e in b.eval_examples()} != {e.prompt for e in c.eval_examples()}
    assert len(_task(tmp_path, user_mod, eval_path=None).eval_examples()) == 1   # default 10%


def test_fields_reach_the_reward(tmp_path, user_mod):
    task = _task(tmp_path, user_mod, reward_fn=f"{user_mod}:echo")
    ex = task.train_examples()[0]
    assert task.reward(ex, "x") == len(ex.prompt) + 2                 # answer, level
    task = _task(tmp_path, user_mod, reward_fn=f"{user_mod}:echo", fields=["level"])
    assert task.reward(task.train_examples()[0], "x") == len(ex.prompt) + 1
    task = _task(tmp_path, user_mod, reward_fn=f"{user_mod}:only_level")   # no **fields
    assert [task.reward(e, "") for e in task.train_examples()[:3]] == [0.0, 1.0, 2.0]
    task = _task(tmp_path, user_mod, reward_fn=f"{user_mod}:length")
    assert task.reward(ex, "12345") == pytest.approx(-0.5)


def test_weighted_rewards_by_hand(tmp_path, user_mod):
    task = _task(tmp_path, user_mod, rewards=[
        {"fn": f"{user_mod}:correct", "weight": 2.0},
        {"fn": f"{user_mod}:length", "weight": 0.5, "name": "brevity"},
        f"{user_mod}:only_level"])
    assert task.reward_weights == {"correct": 2.0, "brevity": 0.5, "only_level": 1.0}
    ex = task.train_examples()[2]                                     # "2 + 2 =", level 2
    assert task.reward_components(ex, "4") == {"correct": 1.0, "brevity": pytest.approx(-0.1),
                                               "only_level": 2.0}
    assert task.reward(ex, "4") == pytest.approx(2 * 1.0 + 0.5 * -0.1 + 2.0)
    assert task.reward(ex, "55") == pytest.approx(0 + 0.5 * -0.2 + 2.0)


def test_batched_reward_function(tmp_path, user_mod):
    task = _task(tmp_path, user_mod, rewards=[{"fn": f"{user_mod}:batched", "weight": 3.0}])
    exs = task.train_examples()[:3]
    assert task.rewards[0].batched and task.score_in_batches
    rows = task.reward_components_batch(exs, ["0", "x", "4"])
    assert rows == [{"batched": 1.0}, {"batched": 0.0}, {"batched": 1.0}]
    assert task.reward(exs[2], "4") == 3.0


def test_reward_by_file_path_and_builtin(tmp_path, user_mod):
    fn = load_function(f"{tmp_path / 'byo_rewards_t.py'}:correct", "task.reward_fn")
    assert fn("p", "4", "4") == 1.0
    rows = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "Half of 1?", "answer": "1/2"}]
    task = build_task("jsonl", train_path=_jsonl(tmp_path / "m.jsonl", rows),
                      eval_path=str(tmp_path / "m.jsonl"), reward_fn="math")
    a, b = task.eval_examples()
    assert task.reward(a, "The answer is \\boxed{4}") == 1.0 and task.reward(a, "5") == 0.0
    assert task.reward(b, "0.5") == 1.0 and task.is_correct(b, "$\\frac{1}{2}$")


@pytest.mark.parametrize("kw, msg", [
    (dict(reward_fn=None), r"needs a reward: task.reward_fn=package.module:function"),
    (dict(reward_fn="nosuchmod_xyz:f"), r"cannot import module 'nosuchmod_xyz'.*PYTHONPATH"),
    (dict(reward_fn="{mod}:nope"), r"module '\w+' has no attribute 'nope'"),
    (dict(reward_fn="{mod}"), r"must look like package.module:function"),
    (dict(reward_fn="{mod}:not_a_reward"), r"must take \(prompt, completion, \*\*fields\)"),
    (dict(reward_fn="{mod}:needs_missing"), r"needs field\(s\) missing that the data does not"),
    (dict(rewards=[{"fn": "{mod}:correct", "wieght": 1}]), r"task.rewards\[0\]: unknown key 'wieght'"),
    (dict(rewards=[{"fn": "{mod}:correct", "weight": "x"}]), r"weight must be a finite number"),
    (dict(rewards=["{mod}:correct", "{mod}:correct"]), r"two rewards are named 'correct'"),
    (dict(rewards=[{"fn": "{mod}:correct", "name": "mean"}]), r"'mean' is taken by the engine"),
    (dict(reward_fn="{mod}:correct", rewards=["{mod}:correct"]), r"not both"),
    (dict(prompt_field="question"), r"task.prompt_field 'question' is not a column"),
    (dict(fields=["nope"]), r"task.fields: 'nope' is not a column"),
    (dict(train_path=None), r"task=jsonl needs task.train_path"),
    (dict(num_digits=3), r"task.num_digits does not apply to task 'jsonl'; its options: .*train_path"),
    (dict(prompt_format="html"), r"invalid task.prompt_format 'html'; valid: raw, chat"),
    (dict(on_reward_error="ignore"), r"invalid task.on_reward_error 'ignore'; valid: zero, raise"),
    (dict(reward_timeout_s=-1), r"invalid task.reward_timeout_s '-1'"),
    (dict(system_prompt="be brief"), r"task.system_prompt needs task.prompt_format=chat"),
])
def test_option_errors_are_one_line_value_errors(tmp_path, user_mod, kw, msg):
    kw = {k: (v.replace("{mod}", user_mod) if isinstance(v, str) else
              [{kk: (vv.replace("{mod}", user_mod) if isinstance(vv, str) else vv)
                for kk, vv in i.items()} if isinstance(i, dict) else i.replace("{mod}", user_mod)
               for i in v] if isinstance(v, list) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=msg) as err:
        _task(tmp_path, user_mod, **kw)
    assert "\n" not in str(err.value)


def test_irrelevant_null_keys_are_ignored(tmp_path, user_mod):
    task = _task(tmp_path, user_mod, num_digits=None, ops=None, style=None, reward=None)
    assert task.name == "jsonl"


def test_chat_messages_need_chat_format(tmp_path, user_mod):
    rows = [{"prompt": [{"role": "user", "content": "2 + 2 ="}], "answer": "4"}] * 3
    with pytest.raises(ValueError, match="holds chat messages; set task.prompt_format=chat"):
        _task(tmp_path, user_mod, train_path=_jsonl(tmp_path / "c.jsonl", rows))   # read at build


def test_parse_rewards_names_default_to_function_names(user_mod):
    rs = parse_rewards(None, [f"{user_mod}:correct", {"fn": "math", "weight": 0.5}])
    assert [(r.name, r.weight, r.batched) for r in rs] == [("correct", 1.0, False),
                                                          ("math", 0.5, False)]
