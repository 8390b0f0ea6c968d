"""Prompts longer than the context (rollout.max_prompt_tokens, task.long_prompts) on a
GPT-2 with 32 learned positions, where a 100-token prompt used to die mid-run with an
IndexError; and the one-line warning for group-relative advantages with group_size=1.

The limit here is 32 - rollout.max_new_tokens (8) = 24 tokens; the short prompts have
well under 24 tokens and the long one at least 100 (both counted with the tokenizer)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from real_arch import _config, build_tokenizer  # noqa: E402

from rlctl.config.compose import compose# noqa: E402
from rlctl.train.preflight import group_size_warning# noqa: E402

RLCTL = str(Path(sys.executable).parent / "rlctl")
LIMIT, NEW = 24, 8
LIMITS = f"rollout.max_prompt_tokens={LIMIT} (the model's context 32 minus rollout.max_new_tokens {NEW})"


@pytest.fixture(scope="module")
def gpt2_32(tmp_path_factory):
    """(model dir, tokenizer) of a random-init GPT-2 with n_positions=32."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("gpt2_32")
    tok = build_tokenizer("gpt2")
    config = _config("gpt2", tok)
    config.n_positions = 32
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, tok


def _long_text(tok, at_least=100):
    words = "the quick brown fox sorts nine digits before the lazy dog wakes up".split()
    text, i = "", 0
    while len(tok(text)["input_ids"]) < at_least:
        text += (" " if text else "") + words[i % len(words)] + str(i % 7)
        i += 1
    return text


@pytest.fixture(scope="module")
def data(gpt2_32, tmp_path_factory):
    _, tok = gpt2_32
    d = tmp_path_factory.mktemp("long_data")
    short = [f"sort {a} {b} {c}" for a, b, c in ((3, 1, 2), (9, 4, 7), (5, 8, 6), (2, 2, 1))]
    rows = short[:2] + [_long_text(tok)] + short[2:]          # the long one is line 3
    for p in short:
        assert len(tok(p)["input_ids"]) <= LIMIT // 2
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "1 2 3"}) + "\n"
                                           for p in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "1 2 3"}) + "\n"
                                          for p in short[:2]))
    return d, rows


def _train(model_dir, d, tmp_path, *extra, in_process=None):
    """`rlctl train` on the GPT-2 with a 32-position context: through the console script,
    or through ``in_process`` (``rlctl_app``: the same CLI app in this process)."""
    args = ["train", "model=hf", f"model.name_or_path={model_dir}", "task=jsonl",
            f"task.train_path={d / 'train.jsonl'}", f"task.eval_path={d / 'eval.jsonl'}",
            "task.reward_fn=exact", "trainer.steps=2", "trainer.prompts_per_step=2",
            "algo.group_size=2", f"rollout.max_new_tokens={NEW}", "trainer.eval_every=0",
            "logger=jsonl", "run.save_model=false", f"run.output_dir={tmp_path / 'runs'}", *extra]
    if in_process is not None:
        return in_process(*args, cwd=tmp_path)
    out = subprocess.run([RLCTL, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline",
                                  TOKENIZERS_PARALLELISM="false"))
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def _lines(stderr, word):
    return [ln for ln in stderr.splitlines() if word in ln]


def test_skip_trains_and_counts_in_one_line(gpt2_32, data, tmp_path):
    out = _train(gpt2_32[0], data[0], tmp_path)                   # skip is the default
    assert out.returncode == 0, out.stderr[-3000:]
    assert _lines(out.stderr, "long_prompts") == [
        f"rlctl: task.long_prompts=skip: skipped 1 of 5 train prompts and 0 of 2 eval prompts "
        f"longer than {LIMITS}"]
    assert list((tmp_path / "runs").iterdir())


def test_error_names_the_row_before_a_run_dir(gpt2_32, data, tmp_path, rlctl_app):
    out = _train(gpt2_32[0], data[0], tmp_path, "task.long_prompts=error", in_process=rlctl_app)
    assert out.returncode == 2, out.stderr[-3000:]
    [line] = [ln for ln in out.stderr.splitlines() if ln.strip()]
    n = len(gpt2_32[1](data[1][2])["input_ids"])
    assert f"train.jsonl:3: the prompt has {n} tokens, more than {LIMITS}" in line, line
    runs = tmp_path / "runs"
    assert not runs.exists() or not list(runs.iterdir())


def test_truncate_left_trains(gpt2_32, data, tmp_path, rlctl_app):
    out = _train(gpt2_32[0], data[0], tmp_path, "task.long_prompts=truncate_left",
                 in_process=rlctl_app)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _lines(out.stderr, "long_prompts") == [
        f"rlctl: task.long_prompts=truncate_left: truncated on the left 1 of 5 train prompts and "
        f"0 of 2 eval prompts longer than {LIMITS}"]


def _bound_task(model_dir, d, *overrides):
    """(the task prepared for the model, its tokenizer) as `rlctl train` prepares it."""
    from rlctl.train.build import model_from_config, prepare_task, task_from_config

    cfg = compose(["model=hf", f"model.name_or_path={model_dir}", "task=jsonl",
                   f"task.train_path={d / 'train.jsonl'}", f"task.eval_path={d / 'eval.jsonl'}",
                   "task.reward_fn=exact", f"rollout.max_new_tokens={NEW}", *overrides]).cfg
    OmegaConf.resolve(cfg)
    built = task_from_config(cfg)
    model, _, tok, _ = model_from_config(cfg)
    return prepare_task(cfg, tok, model, built, quiet=True), tok


def test_truncate_left_keeps_the_last_tokens(gpt2_32, data):
    d, rows = data
    prepared, tok = _bound_task(gpt2_32[0], d, "task.long_prompts=truncate_left")
    examples, task = prepared.train, prepared.task
    assert [ex.prompt for ex in task.train_examples()] == rows      # the task is as built
    assert [ex.prompt for i, ex in enumerate(examples) if i != 2] == [r for i, r in enumerate(rows) if i != 2]
    kept = examples[2]
    full = tok(rows[2])["input_ids"]
    assert tok(kept.prompt)["input_ids"] == full[-LIMIT:]          # exactly the last 24 tokens
    assert rows[2].endswith(kept.prompt) and len(kept.prompt) < len(rows[2])
    # the reward still sees the whole prompt
    assert task._args(kept)[0] == rows[2] and "_source" not in task._args(kept)[1]


def test_explicit_limit_and_no_room(gpt2_32, data):
    from rlctl.errors import UserError

    d, rows = data
    prepared, tok = _bound_task(gpt2_32[0], d, f"rollout.max_prompt_tokens={LIMIT // 2}")
    assert [ex.prompt for ex in prepared.train] == rows[:2] + rows[3:]
    with pytest.raises(UserError, match=r"^rollout.max_prompt_tokens=30 plus rollout.max_new_tokens=8 "
                                        r"exceeds the model's context of 32 positions"):
        _bound_task(gpt2_32[0], d, "rollout.max_prompt_tokens=30")
    with pytest.raises(UserError, match="rollout.max_new_tokens=32 leaves no room for a prompt"):
        _bound_task(gpt2_32[0], d, "rollout.max_new_tokens=32")
    with pytest.raises(UserError, match="all 5 train prompts are longer than rollout.max_prompt_tokens=1"):
        _bound_task(gpt2_32[0], d, "rollout.max_prompt_tokens=1")


def test_bad_long_prompts_value_is_one_line(tmp_path, rlctl_app):
    out = rlctl_app("train", "--dry-run", "task.long_prompts=cut", cwd=tmp_path)   # in-process
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "invalid task.long_prompts 'cut'; valid: skip, truncate_left, error" in out.stderr


@pytest.mark.parametrize("overrides,warns", [
    (["algo=grpo", "algo.group_size=1"], True), (["algo=dr_grpo", "algo.group_size=1"], True),
    (["algo=rloo", "algo.group_size=1"], True), (["algo=grpo", "algo.advantage=rloo", "algo.group_size=1"], True),
    (["algo=reinforce", "algo.group_size=1"], False), (["algo=grpo", "algo.group_size=2"], False),
    (["algo=ppo", "algo.group_size=1"], False),
])
def test_group_size_one_warning(overrides, warns):
    algo = compose(overrides).cfg.algo
    message = group_size_warning(algo)
    assert (message is not None) == warns
    if warns:
        assert message.startswith(f"algo.group_size=1 with algo.advantage={algo.advantage}: ")
        assert "\n" not in message


def test_train_warns_once_for_group_size_one_and_trains(tmp_path):
    args = ["train", f"run.output_dir={tmp_path}", "trainer.steps=1", "trainer.eval_every=0",
            "trainer.prompts_per_step=2", "algo.group_size=1", "logger=jsonl", "run.save_model=false"]
    out = subprocess.run([RLCTL, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline"))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert _lines(out.stderr, "warning") == [
        "rlctl: warning: algo.group_size=1 with algo.advantage=grpo: a group-relative advantage "
        "compares a completion with the others of its group, so every advantage is 0 and the "
        "policy does not learn; use algo.group_size >= 2"]
