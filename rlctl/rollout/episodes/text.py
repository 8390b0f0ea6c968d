"""The text side of an episode: observations to tokens, and where a turn stops."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from rlctl.models.kv_share import say_once
from rlctl.tasks.task import render_chat

ERROR_OBSERVATION = "error"     # what the model sees after a step that raised or timed out
CHARS_PER_TOKEN = 64            # more than any vocabulary's tokens hold: the cut before tokenizing

_DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def uses_chat(tokenizer, prompt_format: str) -> bool:
    return prompt_format == "chat" and bool(getattr(tokenizer, "chat_template", None))


class EpisodeText:
    """Encodes one run's observations (``chat``: through the tokenizer's template)."""

    def __init__(self, tokenizer, chat: bool, system_prompt: Optional[str], max_obs_tokens: int,
                 obs_truncation: str):
        self.tok, self.chat, self.system = tokenizer, chat, system_prompt
        self.max_obs, self.side = max_obs_tokens, obs_truncation
        self.role = self._observation_role() if chat else "user"

    def first(self, text: str) -> Tuple[str, List[int], List[Dict[str, str]]]:
        """(prompt text, its ids with the tokenizer's special tokens, chat messages)."""
        text = valid_text(text)
        if not self.chat:
            return text, self.tok(text)["input_ids"], []
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": text}]
        prompt = render_chat(self.tok, text, self.system)
        return prompt, self.tok(prompt)["input_ids"], messages

    def observation(self, text: str, context: Sequence[int], messages: List[Dict[str, str]],
                    turn_text: str) -> Tuple[List[int], bool, str]:
        """(ids of observation ``text`` after ``context``, cut to max_obs_tokens?, the text
        kept). In chat, ``messages`` gets the assistant's turn and the new message appended."""
        limit = self.max_obs * CHARS_PER_TOKEN
        clipped = len(text) > limit
        if clipped:
            text = text[:limit] if self.side == "right" else text[-limit:]
        text = valid_text(text)
        content, cut = self._cut(self._encode(text))
        cut = cut or clipped
        if cut:
            text = self.tok.decode(content)
        if not self.chat:
            return content, cut, text
        messages += [{"role": "assistant", "content": turn_text}, {"role": self.role, "content": text}]
        full = self._render(messages, generation=True)
        so_far = self.tok.decode(list(context), skip_special_tokens=False)
        if full.startswith(so_far):
            return self._encode(full[len(so_far):]), cut, text
        say_once("the chat template changes earlier text when a turn is added (its rendering "
                 "of the conversation does not start with the tokens already sampled); each "
                 "observation is rendered alone as a message after an assistant turn, and "
                 "earlier tokens are kept as sampled")
        return self._encode(self._alone(messages[-1])), cut, text

    def _observation_role(self) -> str:
        """``tool`` when the template renders a tool message's content, else ``user``."""
        if "tool" not in str(getattr(self.tok, "chat_template", "") or ""):
            return "user"
        marker = "rlctl-observation-probe"
        try:
            text = self._render(_DUMMY + [{"role": "tool", "content": marker}], generation=True)
        except Exception:  # noqa: BLE001 - jinja raises what the template raises
            return "user"
        return "tool" if marker in text else "user"

    def _alone(self, message: Dict[str, str]) -> str:
        before = self._render(_DUMMY, generation=False)
        after = self._render(_DUMMY + [message], generation=True)
        return after[len(before):] if after.startswith(before) else \
            self._render([message], generation=True)

    def _render(self, messages, generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=generation)

    def _encode(self, text: str) -> List[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def _cut(self, ids: List[int]) -> Tuple[List[int], bool]:
        if len(ids) <= self.max_obs:
            return ids, False
        return (ids[:self.max_obs] if self.side == "right" else ids[len(ids) - self.max_obs:]), True

    def turn_text(self, ids: Sequence[int], stops: Sequence[int]) -> str:
        """A model turn's text: its ids without the closing stop id, specials dropped."""
        ids = list(ids[:-1]) if ids and ids[-1] in stops else list(ids)
        return self.tok.decode(ids, skip_special_tokens=True).strip()


def valid_text(text: str) -> str:
    """``text`` as valid UTF-8: what cannot be encoded (a lone surrogate) becomes '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def stop_string_cut(tokenizer, ids: Sequence[int], strings: Sequence[str]) -> Optional[int]:
    """Tokens to keep: up to the one completing the first of ``strings`` in the text, or None."""
    strings = [s for s in strings if s]
    if not strings or not any(s in tokenizer.decode(list(ids), skip_special_tokens=False)
                              for s in strings):
        return None                     # the common case: one decode, no prefix search
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(list(ids[:k]), skip_special_tokens=False)
        if any(s in text for s in strings):
            return k
    return None


def stop_strings(info) -> Tuple[str, ...]:
    """info["stop"] of a step (a string or a list of strings) as a tuple."""
    stop = (info or {}).get("stop") if isinstance(info, dict) else None
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(str(s) for s in stop)
