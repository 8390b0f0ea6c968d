"""Chat observations (rlctl/rollout/episodes/text.py): the template's text for the new
message beyond the tokens already sampled, and the one-line fallback when the template
rewrites earlier text. The tokenizer is real_arch's Qwen2.5-style byte-level BPE."""
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from real_arch import QWEN_TEMPLATE, build_tokenizer  # noqa: E402

from rlctl.models import kv_share  # noqa: E402
from rlctl.rollout.episodes.text import EpisodeText# noqa: E402


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer("qwen2")


def _after_a_turn(tok, text):
    prompt, ids, messages = text.first("sort 3 1 2")
    turn = tok("1 2 3<|im_end|>", add_special_tokens=False)["input_ids"]   # as sampled
    return prompt, ids + turn, messages


def test_an_observation_is_the_templates_text_beyond_the_sampled_tokens(qwen):
    tok = qwen
    tok.chat_template = QWEN_TEMPLATE.replace("{% for m", "{# tool #}{% for m")   # has a tool role
    text = EpisodeText(tok, chat=True, system_prompt=None, max_obs_tokens=64, obs_truncation="right")
    prompt, context, messages = _after_a_turn(tok, text)
    assert prompt == "<|im_start|>user\nsort 3 1 2<|im_end|>\n<|im_start|>assistant\n"
    ids, cut, kept = text.observation("ok", context, messages, "1 2 3")
    # the template writes "\n" after the assistant's <|im_end|>: the model did not sample it
    assert tok.decode(ids) == "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    assert not cut and kept == "ok" and [m["role"] for m in messages] == ["user", "assistant", "tool"]


# hides every assistant turn but the last (as templates that drop earlier reasoning do)
HIDING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' "
          "and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_earlier_text_is_said_once_and_falls_back(qwen, caplog, monkeypatch):
    tok = qwen
    tok.chat_template = HIDING
    monkeypatch.setattr(kv_share, "_said", set())
    text = EpisodeText(tok, chat=True, system_prompt=None, max_obs_tokens=64, obs_truncation="right")
    _, context, messages = _after_a_turn(tok, text)
    with caplog.at_level(logging.WARNING):
        ids, _, _ = text.observation("ok", context, messages, "1 2 3")
        again, _, _ = text.observation("ok", context, messages, "1 2 3")
    # fallback: the user message as written after [user, assistant] (no tool role here)
    assert tok.decode(ids) == "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n" == tok.decode(again)
    said = [r for r in caplog.records if "changes earlier text" in r.getMessage()]
    assert len(said) == 1           # one line, however many observations


def test_a_template_that_names_tools_but_refuses_the_role_gets_user_observations(qwen):
    """A template that mentions tools (a tools list) but raises on a tool message: the
    observation goes out as a user message instead of failing inside the episode loop."""
    tok = qwen
    tok.chat_template = ("{% if tools %}{{ tools }}{% endif %}{% for m in messages %}"
                         "{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
                         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text = EpisodeText(tok, chat=True, system_prompt=None, max_obs_tokens=64, obs_truncation="right")
    assert text.role == "user"
    _, context, messages = _after_a_turn(tok, text)
    ids, _, _ = text.observation("ok", context, messages, "1 2 3")
    assert tok.decode(ids) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
