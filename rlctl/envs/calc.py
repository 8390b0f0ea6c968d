"""The calculator tool and the built-in environments' words; standard library only (sandbox)."""
from __future__ import annotations

import ast
import operator
from typing import Optional

MAX_CHARS = 200           # longest expression calc reads
MAX_DIGITS = 60           # largest intermediate value, in digits

TINY_AGENT_WORDS = (
    "<call>", "</call>", "calc",            # the tag tool-call format and the calculator tool
    "<result>", "</result>", "error",       # tool results and failed calls
    "guess", "higher", "lower",             # guess_number
    "sum",                                  # running_sum
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def read_number(text: str) -> Optional[int]:
    """The integer that digit words spell ("1 2" -> 12, "- 4" -> -4), else None."""
    words = text.split() if isinstance(text, str) else []
    sign = -1 if words[:1] == ["-"] else 1
    digits = "".join(words[1:] if sign < 0 else words)
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    return sign * int(digits)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        v = _OPS[type(node.op)](_value(node.left), _value(node.right))
        if len(str(abs(v))) > MAX_DIGITS:
            raise ValueError(f"a value over {MAX_DIGITS} digits")
        return v
    raise ValueError("only integers and + - * are allowed")


def calc(expression: str) -> int:
    """Integer arithmetic with + - * and parentheses; "1 2 3 * 4 5" is 123 * 45."""
    text = "".join(str(expression).split())
    if not text or len(text) > MAX_CHARS:
        raise ValueError(f"an expression of 1 to {MAX_CHARS} characters is needed")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {text!r}") from None
    return _value(tree.body)
