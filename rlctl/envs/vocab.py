"""The words the built-in environments write or expect beyond digits and ``= + - * :``,
added to the tiny model's word-level vocabulary (formats: docs/agents.md)."""
from __future__ import annotations

TINY_AGENT_WORDS = (
    "<call>", "</call>", "calc",            # the tag tool-call format and the calculator tool
    "<result>", "</result>", "error",       # tool results and failed calls
    "guess", "higher", "lower",             # guess_number
    "sum",                                  # running_sum
)
