"""Generated math (``task=arithmetic``): ``a OP b`` as ``symbolic`` or ``words`` prompts;
OP is +, -, * or ``max`` (the larger of the two, a words-only question)."""
from __future__ import annotations

import random
import re
from typing import Dict, List, Optional, Sequence, Tuple

from rlctl.tasks.task import disjoint_splits, register_task, task_options
from rlctl.tasks.rewards import answers_equivalent, is_just_answer, numbers_in, parse_number, whole_answer
from rlctl.types import Example

OPS = ("+", "-", "*", "max")
STYLES = ("symbolic", "words")
# exact: the final number is right (anywhere after prose); strict: the whole answer is that
# number (a final period allowed); strict_shaped: 1 for strict, 0.5 for the right final number
# inside other text (for max: text that never names the smaller number, so "25 is larger than
# 67" earns nothing), 0.2 for a wrong bare number, else 0 (right beats bare, so the format is
# learned without trading the answer for it); partial: exact, else 0.5 * the digits in place;
# equation: the whole answer is the problem's equation and its result ("12 + 7 = 19", operands
# either way round for + and *; * also as x or ×), equation_shaped: 1 for that, 0.5 for the right
# number inside other text, 0.2 for the problem's equation with a wrong result, else 0
REWARDS = ("exact", "strict", "strict_shaped", "equation", "equation_shaped", "partial")
INSTRUCTIONS = {"strict": " Answer with just the number.",
                "equation": " Answer with one equation and its result, like 2 + 3 = 5."}
_NUMBER = r"(-?(?:0|[1-9][0-9]{0,30}))"     # as written: no leading zeros, at most 31 digits
_EQUATION = re.compile(rf"{_NUMBER}[ \t]*([-+*x×])[ \t]*{_NUMBER}[ \t]*=[ \t]*{_NUMBER}")
RIGHT_CREDIT, FORMAT_CREDIT = 0.5, 0.2

_WORDS = {
    "+": ["{n} has {a} {item} and finds {b} more. How many {item} does {n} have now?",
          "What is {a} plus {b}?",
          "A shelf holds {a} {item} and another holds {b} {item}. How many {item} are there "
          "in all?"],
    "-": ["{n} has {a} {item} and gives away {b}. How many {item} does {n} have left?",
          "What is {a} minus {b}?",
          "A box held {a} {item}; {b} were taken out. How many {item} are in the box now?"],
    "*": ["{n} buys {a} bags with {b} {item} in each. How many {item} does {n} buy?",
          "What is {a} times {b}?",
          "There are {a} rows of {b} {item}. How many {item} are there?"],
    "max": ["Which number is larger, {a} or {b}?",
            "{n} has {a} {item} and a friend has {b}. What is the larger of the two counts?"],
}
_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Eva", "Femi", "Gus", "Hana"]
_ITEMS = ["marbles", "apples", "stamps", "coins", "shells", "cards"]


def compute(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else max(a, b)


def spaced(n: int) -> str:
    """An integer as digit words, one token per digit: 12 -> "1 2", -5 -> "- 5"."""
    return ("- " if n < 0 else "") + " ".join(str(abs(int(n))))


def digit_credit(answer: int, out: Optional[int]) -> float:
    """Share of digits in place, aligned from the units digit, over the longer of the two."""
    if out is None:
        return 0.0
    t, o = str(abs(answer))[::-1], str(abs(out))[::-1]
    hits = sum(x == y for x, y in zip(t, o)) if (answer < 0) == (out < 0) else 0
    return hits / max(len(t), len(o))


@register_task("arithmetic")
class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, num_digits: int = 2, ops: Sequence[str] = ("+",),
                 style: str = "symbolic", reward: str = "exact", num_eval: int = 256,
                 seed: int = 1234, max_train: int = 20000):
        if isinstance(ops, str):
            ops = [o for o in ops.replace(",", " ").split() if o]
        ops = list(ops)
        bad = [o for o in ops if o not in OPS]
        if not ops or bad:
            raise ValueError(f"invalid task.ops {ops}; each must be one of {', '.join(OPS)}")
        if style not in STYLES:
            raise ValueError(f"invalid task.style '{style}'; valid: {', '.join(STYLES)}")
        if "max" in ops and style != "words":
            raise ValueError("task.ops 'max' needs task.style=words (a question in words)")
        if reward.startswith("equation") and "max" in ops:
            raise ValueError("task.reward equation* has no equation for op 'max'; use ops +, - or *")
        if reward not in REWARDS:
            raise ValueError(f"invalid task.reward '{reward}' for arithmetic; valid: "
                             f"{', '.join(REWARDS)}")
        if not isinstance(num_digits, int) or not 1 <= num_digits <= 9:
            raise ValueError(f"invalid task.num_digits '{num_digits}'; must be in [1, 9]")
        self.num_digits, self.ops, self.style = num_digits, ops, style
        space = self._space()
        if not isinstance(num_eval, int) or not 0 <= num_eval < space:
            raise ValueError(f"invalid task.num_eval '{num_eval}'; must be in [0, {space - 1}] "
                             f"for {num_digits}-digit operands and ops {ops}")
        if not isinstance(max_train, int) or max_train < 1:
            raise ValueError(f"invalid max_train '{max_train}'; must be >= 1")
        self.reward_name, self.seed = reward, seed
        hi = 10 ** num_digits
        self._eval, self._train = disjoint_splits(
            self._draw, random.Random(seed), num_eval, max_train, space,
            lambda: ((a, op, b) for op in ops for a in range(hi) for b in range(hi)
                     if not (self._ordered(op) and a < b)))

    # a word problem "a - b" with a < b is asked as "b - a" (one problem, one split)
    def _ordered(self, op: str) -> bool:
        return self.style == "words" and op == "-"

    def _space(self) -> int:
        hi = 10 ** self.num_digits
        return sum(hi * (hi + 1) // 2 if self._ordered(op) else hi * hi for op in self.ops)

    def _draw(self, rng: random.Random) -> Tuple[int, str, int]:
        hi = 10 ** self.num_digits
        a, op, b = rng.randrange(hi), rng.choice(self.ops), rng.randrange(hi)
        return (b, op, a) if self._ordered(op) and a < b else (a, op, b)

    def _example(self, problem: Tuple[int, str, int]) -> Example:
        a, op, b = problem
        equation = self.reward_name.startswith("equation")
        if equation and not self._chat():
            raise ValueError(f"task.reward={self.reward_name} needs task.prompt_format=chat (raw "
                             "prompts ask for the number alone)")
        told = INSTRUCTIONS["equation" if equation else "strict"]
        if self.style == "symbolic" and self._chat():      # a chat model is told the task
            prompt = f"Compute {a} {op} {b}.{told}"
        elif self.style == "symbolic":
            prompt = f"{spaced(a)} {op} {spaced(b)} ="
        else:
            rng = random.Random(f"{a}{op}{b}/{self.seed}")  # the same in every process
            prompt = rng.choice(_WORDS[op]).format(a=a, b=b, n=rng.choice(_NAMES),
                                                   item=rng.choice(_ITEMS))
            prompt += told if self._chat() else " Give the final answer as a number."
        return Example(prompt=prompt, fields={"a": a, "op": op, "b": b,
                                              "answer": compute(a, op, b)})

    def train_examples(self) -> List[Example]:
        return [self._example(p) for p in self._train]

    def eval_examples(self) -> List[Example]:
        return [self._example(p) for p in self._eval]

    def is_correct(self, example: Example, completion: str) -> bool:
        """Right under the trained reward's rule: the whole answer for strict and equation,
        else the final number."""
        f = example.fields
        if self.reward_name.startswith("equation"):
            return is_equation(completion, f["a"], f["op"], f["b"])
        check = is_just_answer if self.reward_name.startswith("strict") else answers_equivalent
        return check(completion, f["answer"])

    def reward(self, example: Example, completion: str) -> float:
        return score(self.reward_name, example.fields, completion)

    def is_well_formed(self, example: Example, completion: str) -> bool:
        """The output holds a number (right or wrong)."""
        return parse_number(completion) is not None

    def answer(self, example: Example) -> str:
        """The correct completion text (without EOS) under the trained reward; used by the
        supervised warm-up."""
        f = example.fields
        if self.reward_name.startswith("equation"):
            return f"{f['a']} {f['op']} {f['b']} = {f['answer']}"
        return spaced(f["answer"]) if self.style == "symbolic" and not self._chat() else str(f["answer"])

    def _chat(self) -> bool:
        return task_options(self).prompt_format == "chat"

    def score_all(self, example: Example, completion: str) -> Dict[str, float]:
        return {name: score(name, example.fields, completion) for name in self.reward_names()}

    def reward_names(self) -> Tuple[str, ...]:
        """Every reward this task scores each row with (no equation* when 'max' is an op)."""
        return tuple(r for r in REWARDS if "max" not in self.ops or not r.startswith("equation"))


def is_equation(completion, a: int, op: str, b: int, any_result: bool = False) -> bool:
    """Is the whole completion (stripped, one final period allowed) the equation ``a op b = r``
    with r its value (``any_result``: any r), operands either way round for + and *, * also
    written x or ×?"""
    m = _EQUATION.fullmatch(whole_answer(completion))
    if m is None:
        return False
    x, sign, y, out = int(m[1]), "*" if m[2] in "x×" else m[2], int(m[3]), int(m[4])
    pairs = {(a, b), (b, a)} if op in "+*" else {(a, b)}
    return sign == op and (x, y) in pairs and (any_result or out == compute(a, op, b))


def names_loser(fields: Dict, completion: str) -> bool:
    """For ``max`` with a != b: does the completion name the smaller number anywhere (as a
    number, "1,000" and "60.0" whole, either sign)?"""
    if fields["op"] != "max" or fields["a"] == fields["b"]:
        return False
    loser = abs(min(fields["a"], fields["b"]))
    return any(abs(x) == loser for x in numbers_in(completion))


def score(reward: str, fields: Dict, completion: str) -> float:
    """The ``reward`` (one of REWARDS) of a completion for the problem ``fields`` (a, op, b, answer)."""
    answer = fields["answer"]
    if reward.startswith(("strict", "equation")):
        shaped = reward.endswith("_shaped")
        if is_just_answer(completion, answer) if reward.startswith("strict") else \
                is_equation(completion, fields["a"], fields["op"], fields["b"]):
            return 1.0
        if shaped and answers_equivalent(completion, answer) and not names_loser(fields, completion):
            return RIGHT_CREDIT
        formed = re.fullmatch(r"-?[0-9]+", whole_answer(completion)) is not None \
            if reward.startswith("strict") else \
            is_equation(completion, fields["a"], fields["op"], fields["b"], any_result=True)
        return FORMAT_CREDIT if formed and shaped else 0.0
    if answers_equivalent(completion, answer):
        return 1.0
    if reward == "exact":
        return 0.0
    got = parse_number(completion)
    out = int(got) if got is not None and got.denominator == 1 else None
    return 0.5 * digit_credit(answer, out)
