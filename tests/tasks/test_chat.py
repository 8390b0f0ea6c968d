"""task.prompt_format=chat with a tokenizer that has a chat template, built locally:
prompts go through apply_chat_template(..., add_generation_prompt=True) (optional system
prompt, no doubled BOS) and rewards see the assistant text only. ``prepare`` builds them
apart: the task itself is never changed."""
import io
import json

import pytest
import torch

from rlctl.errors import UserError
from rlctl.tasks import build_task
from rlctl.tasks.task import (RAW_PROMPT, assistant_text, chat_messages, end_of_turn_markers,
                              render_chat)
from rlctl.tasks.prompt_budget import prepare

ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_tokenizer(template=TEMPLATE):
    """The tiny model's word-level tokenizer plus role tokens and a chat template;
    EOS is the end-of-turn token, as instruct models have it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rlctl.demo.tiny import SPECIAL_TOKENS, SYMBOLS

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + SYMBOLS + ROLES + ["be", "brief"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<|end|>", unk_token="<unk>", padding_side="left",
                                  additional_special_tokens=ROLES[:3])
    tok.chat_template = template
    return tok


REWARD = '''
def reward(prompt, completion, answer, **fields):
    assert isinstance(prompt, (str, list)) and "<|" not in str(prompt), prompt  # the user's prompt
    return 1.0 if completion == answer else 0.0
'''


@pytest.fixture()
def data(tmp_path, monkeypatch):
    (tmp_path / "chat_reward_t.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": "2 + 2 =", "answer": "4"},
            {"prompt": [{"role": "system", "content": "be"}, {"role": "user", "content": "3 + 3 ="}],
             "answer": "6"}]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _task(data, **kw):
    return build_task("jsonl", train_path=data, eval_path=data, reward_fn="chat_reward_t:reward",
                      prompt_format="chat", reward_timeout_s=10, **kw)


def test_prompts_are_rendered_by_the_chat_template(data):
    tok = chat_tokenizer()
    task = _task(data, system_prompt="be brief")
    a, b = prepare(task, tok).train
    assert [ex.prompt for ex in task.train_examples()] == ["2 + 2 =", "3 + 3 ="]   # as built
    expect_a = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2 ="}],
        tokenize=False, add_generation_prompt=True)
    assert expect_a.startswith("<bos>") and a.prompt == expect_a[len("<bos>"):]
    assert a.prompt == "<|system|> be brief <|end|> <|user|> 2 + 2 = <|end|> <|assistant|> "
    # a row's own system message is kept; the configured one is not added twice
    assert b.prompt == "<|system|> be <|end|> <|user|> 3 + 3 = <|end|> <|assistant|> "
    assert a.fields[RAW_PROMPT] == "2 + 2 =" and a.fields["answer"] == "4"
    ids = tok(a.prompt)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id   # not doubled
    assert tok.unk_token_id not in ids


def test_without_system_prompt_and_template_without_bos(data):
    tok = chat_tokenizer(TEMPLATE.replace("{{ bos_token }}", ""))
    task = _task(data)
    a = prepare(task, tok).eval[0]
    assert a.prompt == tok.apply_chat_template([{"role": "user", "content": "2 + 2 ="}],
                                               tokenize=False, add_generation_prompt=True)
    assert a.prompt == "<|user|> 2 + 2 = <|end|> <|assistant|> "


def test_scoring_sees_the_assistant_text_only(data):
    tok = chat_tokenizer()
    task = _task(data)
    prepared = prepare(task, tok)
    a, b = prepared.eval
    assert end_of_turn_markers(tok)[0].startswith("<|")
    assert prepared.markers == tuple(end_of_turn_markers(tok))
    assert assistant_text("4 <|end|> <|user|> 9 =", end_of_turn_markers(tok)) == "4"
    with prepared.scorer() as scorer:
        # the reply, then the end-of-turn marker and a hallucinated next turn: only "4"
        # counts; the whole conversation echoed back (prompt + reply): the reply too
        completions = ["4 <|end|> <|user|> 2 + 2 = <|end|> <|assistant|> 5", "5 <|end|> 4",
                       b.prompt + "6 <|end|>", "6<|end|>"]
        rewards = scorer.score_batch([a, a, b, b], completions)
        assert rewards == [1.0, 0.0, 1.0, 1.0] and scorer.errors == 0
        assert scorer.correct_batch([a, a], [" 4 <|end|>", "5 <|end|> 4"], [1.0, 0.0]) == [True, False]
    # the task itself sees the text as given (it was not wrapped)
    assert task.reward(a, "4 <|end|> 9") == 0.0


def test_builtin_task_in_chat_format():
    tok = chat_tokenizer()
    task = build_task("arithmetic", num_eval=3, prompt_format="chat", system_prompt="be brief",
                      reward_timeout_s=0)
    prepared = prepare(task, tok)
    ex = prepared.eval[0]
    raw = ex.fields[RAW_PROMPT]
    assert ex.prompt == f"<|system|> be brief <|end|> <|user|> {raw} <|end|> <|assistant|> "
    good = task.answer(ex)
    with prepared.scorer() as scorer:
        assert scorer.correct_batch([ex], [f"{good} <|end|> <|user|> 1 ="], [0.0]) == [True]
        assert scorer.score_batch([ex], [f"{good} <|end|> 1"]) == [1.0]


def test_tokenizer_without_chat_template_fails_in_one_line(data):
    from rlctl.demo.tiny import build_tokenizer

    task = _task(data)
    with pytest.raises(UserError, match="task.prompt_format: task.prompt_format=chat needs a "
                                        "tokenizer with a chat template; this model's tokenizer has none"):
        prepare(task, build_tokenizer())
    with pytest.raises(ValueError):
        render_chat(build_tokenizer(), "x")


def test_rollout_with_a_chat_model(data, tmp_path):
    """A small Llama with the chat tokenizer, saved and reloaded like an HF checkpoint:
    the engine's rollout samples from the rendered prompts and the scorer scores the
    decoded assistant replies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.demo.tiny import build_model
    from rlctl.rollout.generate import rollout

    tok = chat_tokenizer()
    build_model(tok, 32, 1, 2, seed=0).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok.chat_template == TEMPLATE
    task = _task(data, system_prompt="be brief")
    prepared = prepare(task, tok)
    exs = list(prepared.train)
    scorer = prepared.scorer()
    try:
        torch.manual_seed(0)
        batch = rollout(model, tok, exs, 3, 4, 1.0, 0, scorer.score_batch)
        assert batch.prompts == [exs[0].prompt] * 3 + [exs[1].prompt] * 3
        expect = [task.reward(exs[i // 3], assistant_text(c, prepared.markers, exs[i // 3].prompt))
                  for i, c in enumerate(batch.completions)]
        assert batch.rewards.tolist() == expect
        for c in batch.completions:
            assert "<|end|>" not in c and "<|user|>" not in c
        fixed = scorer.score_batch(exs, ["4", "6"])
        assert fixed == [1.0, 1.0] and scorer.errors == 0
    finally:
        scorer.close()


def test_sample_tables_show_the_users_text(data):
    """The console's prompt column shows the user's text, not the chat template's header;
    the rows (samples.jsonl) keep the rendered prompt beside it as user_prompt."""
    from rich.console import Console

    from rlctl.demo.tiny import build_model
    from rlctl.rollout.generate import rollout
    from rlctl.sinks.console import sample_table
    from rlctl.train.evaluate import evaluate
    from rlctl.train.metrics import train_rows, user_prompts

    tok = chat_tokenizer()
    prepared = prepare(_task(data, system_prompt="be brief"), tok)
    exs, model = list(prepared.train), build_model(tok, 32, 1, 2, seed=0)
    users = ["2 + 2 =", "3 + 3 ="]
    with prepared.scorer() as scorer:
        ev = evaluate(model, tok, list(prepared.eval), scorer=scorer, max_new_tokens=2, keep=2)
        torch.manual_seed(0)
        batch = rollout(model, tok, exs, 2, 2, 1.0, 0, scorer.score_batch)
    train = train_rows(batch, [0, 2], 1, batch.rewards, tok, [tok.eos_token_id],
                       users=user_prompts(exs))
    for rows in (ev.rows, train):
        assert [r["prompt"] for r in rows] == [ex.prompt for ex in exs]    # as rendered
        assert [r["user_prompt"] for r in rows] == users
        console = Console(width=120, record=True, file=io.StringIO())
        console.print(sample_table(rows, 1, "t", 120))
        text = console.export_text()
        assert all(u in text for u in users) and "<|system|>" not in text, text
        assert "user_prompt" not in text


RAW = [  # (task, options, sha256[:16] of every train + eval prompt, the first two) before chat instructions
    ("sorting", dict(num_digits=3, num_eval=4), "0b55e4b69f4afb78", ["6 2 2 =", "9 4 5 ="]),
    ("arithmetic", dict(num_eval=4, ops=["+", "-", "*"]), "450eef234934b77e", ["4 5 + 2 =", "3 + 4 4 ="]),
    ("arithmetic", dict(num_eval=4, style="words", ops=["-"]), "7a8f906e2f83baff",
     ["A box held 89 coins; 80 were taken out. How many coins are in the box now? Give the final "
      "answer as a number.", "Dev has 85 coins and gives away 70. How many coins does Dev have "
      "left? Give the final answer as a number."]),
]


@pytest.mark.parametrize("name,kw,digest,first", RAW, ids=["sorting", "symbolic", "words"])
def test_builtin_chat_prompts_state_the_task_and_raw_prompts_are_unchanged(name, kw, digest, first):
    import hashlib

    raw = build_task(name, **kw)
    prompts = [e.prompt for e in raw.train_examples() + raw.eval_examples()]
    assert prompts[:2] == first
    assert hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16] == digest
    chat = build_task(name, prompt_format="chat", **kw)
    rows = chat.train_examples()[:50] + chat.eval_examples()
    expect = {"sorting": "Sort these digits in ascending order. Answer with just the sorted digits "
                         "separated by spaces: ",
              "arithmetic": "Compute "}[name]
    for ex, plain in zip(rows, raw.train_examples()[:50] + raw.eval_examples()):
        assert ex.fields == plain.fields
        if kw.get("style") == "words":    # the same problem, asking for what strict scores
            assert ex.prompt == plain.prompt.replace("Give the final answer as a number.",
                                                     "Answer with just the number.")
            assert ex.prompt != plain.prompt and chat.reward(ex, chat.answer(ex)) == 1.0
            continue
        assert ex.prompt.startswith(expect) and "=" not in ex.prompt, ex.prompt
        if name == "sorting":
            assert ex.prompt.endswith(": " + " ".join(map(str, ex.fields["digits"])))
        else:
            f = ex.fields
            assert ex.prompt == f"Compute {f['a']} {f['op']} {f['b']}. Answer with just the number."
        # the answer the instruction asks for is what the reward scores full marks
        good = chat.answer(ex)
        assert chat.reward(ex, good) == 1.0 and chat.is_correct(ex, good), (ex.prompt, good)
    assert chat_messages(rows[0].prompt, None)[0]["content"] == rows[0].prompt
