"""Sort n digits (``"3 1 4 1 5 ="`` -> ``"1 1 3 4 5"``); rewards: docs/math.md, section 10."""
from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

from rlctl.tasks.task import disjoint_splits, register_task, task_options
from rlctl.types import Example

_DIGITS = {str(d): d for d in range(10)}


def parse_digits(completion: str) -> Optional[List[int]]:
    """The completion's digits, or None when a whitespace token is not one digit 0-9."""
    if not isinstance(completion, str):
        return None
    out = [_DIGITS.get(tok) for tok in completion.split()]
    return None if None in out else out


def exact_reward(digits: Sequence[int], out: Optional[List[int]]) -> float:
    return float(out is not None and out == sorted(digits))


def positional_reward(digits: Sequence[int], out: Optional[List[int]]) -> float:
    if not out:
        return 0.0
    target = sorted(digits)
    return sum(o == t for o, t in zip(out, target)) / max(len(target), len(out))


def inclusion_order_reward(digits: Sequence[int], out: Optional[List[int]]) -> float:
    if not out:
        return 0.0
    present = set(digits)
    included = sum(o in present for o in out)
    ordered = sum(a <= b for a, b in zip(out, out[1:]))
    return (included + ordered) / (2 * len(digits) - 1)  # unclipped: may exceed 1


REWARDS = {"exact": exact_reward, "positional": positional_reward,
           "inclusion_order": inclusion_order_reward}


def reward_names() -> Tuple[str, ...]:
    return tuple(REWARDS)


def score_all(digits: Sequence[int], completion: str) -> Dict[str, float]:
    """Every reward design on one completion."""
    out = parse_digits(completion)
    return {name: fn(digits, out) for name, fn in REWARDS.items()}


INSTRUCTION = ("Sort these digits in ascending order. Answer with just the sorted digits "
               "separated by spaces: ")   # under task.prompt_format=chat


def format_prompt(digits: Sequence[int], chat: bool = False) -> str:
    return INSTRUCTION + " ".join(map(str, digits)) if chat else " ".join(map(str, digits)) + " ="


def format_answer(digits: Sequence[int]) -> str:
    return " ".join(map(str, sorted(digits)))


def noisy_answer(digits: Sequence[int], rng: random.Random) -> List[int]:
    """One answer: right, swapped or permuted, a digit dropped or repeated 35% of the time."""
    out = sorted(digits)
    kind = rng.random()
    if kind < 0.2:                        # the right answer
        pass
    elif kind < 0.5:                      # one or two random swaps of the sorted answer
        for _ in range(rng.choice((1, 2))):
            i, j = rng.sample(range(len(out)), 2)
            out[i], out[j] = out[j], out[i]
    elif kind < 0.65:                     # a random permutation of the prompt's digits
        rng.shuffle(out)
    if rng.random() < 0.35:               # a digit dropped or repeated
        i = rng.randrange(len(out))
        out = out[:i] + out[i + 1:] if rng.random() < 0.5 else out[:i + 1] + out[i:]
    return out


@register_task("sorting")
class SortingTask:
    """Eval: ``num_eval`` tuples drawn with ``random.Random(seed)``, disjoint from training."""

    name = "sorting"
    reward_names = staticmethod(reward_names)

    def __init__(self, num_digits: int = 5, reward: str = "positional", num_eval: int = 256,
                 seed: int = 1234, max_train: int = 20000):
        if reward not in REWARDS:
            raise ValueError(f"unknown sorting reward '{reward}'; valid: {', '.join(REWARDS)}")
        if num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {num_digits}")
        space = 10 ** num_digits
        if not 0 <= num_eval < space:
            raise ValueError(f"num_eval must be in [0, {space - 1}] for {num_digits} digits, "
                             f"got {num_eval}")
        self.num_digits, self.reward_name = num_digits, reward
        self.reward_weights = {name: float(name == reward) for name in REWARDS}
        self._eval, self._train = disjoint_splits(
            self._draw, random.Random(seed), num_eval, max_train, space,
            lambda: (tuple(int(c) for c in str(i).zfill(num_digits)) for i in range(space)))

    def _draw(self, rng: random.Random) -> Tuple[int, ...]:
        return tuple(rng.randrange(10) for _ in range(self.num_digits))

    @staticmethod
    def _example(digits: Sequence[int], chat: bool = False) -> Example:
        digits = list(digits)
        return Example(prompt=format_prompt(digits, chat),
                       fields={"digits": digits, "target": sorted(digits)})

    def train_examples(self) -> List[Example]:
        return [self._example(t, self._chat()) for t in self._train]

    def eval_examples(self) -> List[Example]:
        return [self._example(t, self._chat()) for t in self._eval]

    def _chat(self) -> bool:
        return task_options(self).prompt_format == "chat"

    def reward(self, example: Example, completion: str) -> float:
        return REWARDS[self.reward_name](example.fields["digits"], parse_digits(completion))

    def is_correct(self, example: Example, completion: str) -> bool:
        return exact_reward(example.fields["digits"], parse_digits(completion)) == 1.0

    def is_well_formed(self, example: Example, completion: str) -> bool:
        """The answer format: exactly n single digits (right or wrong)."""
        out = parse_digits(completion)
        return out is not None and len(out) == len(example.fields["digits"])

    def score_all(self, example: Example, completion: str) -> Dict[str, float]:
        return score_all(example.fields["digits"], completion)

    reward_components = score_all

    def preference_pairs(self, examples: Sequence[Example], n: int, seed: int) -> List[Example]:
        """``n`` pairs cycling through ``examples``: fields chosen (the sorted digits) and
        rejected (a ``noisy_answer`` that is not sorted) (``task.pairs_from=sorting``)."""
        rng, out = random.Random(seed), []
        while len(out) < n:
            ex = examples[len(out) % len(examples)]
            digits = ex.fields["digits"]
            wrong = noisy_answer(digits, rng)
            while wrong == sorted(digits):
                wrong = noisy_answer(digits, rng)
            out.append(Example(ex.prompt, {**ex.fields, "chosen": format_answer(digits),
                                           "rejected": " ".join(map(str, wrong))}))
        return out

    @staticmethod
    def answer(example: Example) -> str:
        """The correct completion text (without EOS); used by the supervised warm-up."""
        return format_answer(example.fields["digits"])
