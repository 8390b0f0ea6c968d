"""The words the built-in environments write or expect, beyond digits and ``= + - * :``.

The embedded tiny model's tokenizer is word-level (whitespace-separated words, digits
as separate words: ``1 2 3`` is 123); it adds these words to its vocabulary for the
environment tasks. Text formats (docs/agents.md):

- tool calls (``tag`` parser): ``<call> calc 1 2 3 * 4 5 </call>``; tool results
  ``<result> 5 5 3 5 </result>``, a failed call ``<result> error </result>``;
- calculator: prompt ``1 2 3 * 4 5 =``, final answer ``5 5 3 5``;
- guess_number: prompt ``guess 1 6 :``, turns ``8``, observations ``higher`` / ``lower``;
- running_sum: prompt ``sum 3 + 4 =``, turns ``7``, observations ``+ 2 =``.
"""
from __future__ import annotations

TINY_AGENT_WORDS = (
    "<call>", "</call>", "calc",            # the tag tool-call format and the calculator tool
    "<result>", "</result>", "error",       # tool results and failed calls
    "guess", "higher", "lower",             # guess_number
    "sum",                                  # running_sum
)
