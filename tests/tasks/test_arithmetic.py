"""task=arithmetic and the math verifier: equivalent answer forms, extraction, splits,
rewards by hand, the tiny vocabulary, and the tiny model's arithmetic warm-up key."""
import os
import subprocess
import sys

import pytest

from rlctl.tasks import build_task
from rlctl.tasks.arithmetic import ArithmeticTask, digit_credit, spaced
from rlctl.tasks.rewards import answers_equivalent, final_answer_text, parse_number

EQUIVALENT_46 = ["46", " 46 ", "46.0", "46.000", "4.6e1", "4.6E+1", "46/1", "92/2", "+46",
                 "$46$", "\\boxed{46}", "The answer is 46.", "answer: 46", "#### 46",
                 "4 6", "12 + 34 = 46", "so \\boxed{46} apples", "\\frac{92}{2}",
                 "\\boxed{\\frac{92}{2}}"]
NOT_46 = ["47", "", "   ", "4 7", "46.5", "4.6", "-46", "460", "4 6 4 6", "forty-six",
          "\\boxed{47}", "The answer is 47.", "46 then 47", None, 46]


@pytest.mark.parametrize("completion", EQUIVALENT_46)
def test_equivalent_forms_are_accepted(completion):
    assert answers_equivalent(completion, 46)
    assert answers_equivalent(completion, "46")


@pytest.mark.parametrize("completion", NOT_46)
def test_other_answers_are_rejected(completion):
    assert not answers_equivalent(completion, 46)


@pytest.mark.parametrize("completion, answer", [
    ("1,234", 1234), ("1 234", 1234), ("- 1 2", -12), ("-12", "-12"), ("0.5", "1/2"),
    ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("0.5", "\\frac{1}{2}"), ("1000000", "1,000,000"),
    ("The answer is 0.1", 0.1), ("2.3", 2.3), ("0.1", 1e-1),     # a float answer means its decimal
])
def test_more_equivalences(completion, answer):
    assert answers_equivalent(completion, answer)


def test_math_verify_is_the_latex_path():
    pytest.importorskip("math_verify")
    # only math-verify reads LaTeX fractions and expressions; the numeric parser does not
    assert parse_number("\\frac{92}{2}") != 46
    assert answers_equivalent("\\frac{92}{2}", 46)
    assert answers_equivalent("$\\sqrt{4}$", "2")


def test_extraction():
    assert final_answer_text("x \\boxed{1} y \\boxed{\\frac{3}{4}} z") == "\\frac{3}{4}"
    assert final_answer_text("work... #### 72") == " 72"
    assert parse_number("I think 3, no: the answer is 4 2.") == 42
    assert parse_number("nothing") is None


def test_symbolic_prompts_fit_the_tiny_vocabulary():
    from rlctl.demo.tiny import build_tokenizer

    tok = build_tokenizer()
    task = ArithmeticTask(num_digits=2, ops=["+", "-", "*"], num_eval=32)
    for ex in task.eval_examples() + task.train_examples()[:200]:
        for text in (ex.prompt, task.answer(ex)):
            ids = tok(text)["input_ids"]
            assert tok.unk_token_id not in ids, text
            assert tok.decode(ids, skip_special_tokens=True) == text
        assert task.reward(ex, task.answer(ex)) == 1.0 and task.is_correct(ex, task.answer(ex))


def test_prompt_and_answer_by_hand():
    task = ArithmeticTask(num_eval=4)
    ex = task._example((12, "+", 34))
    assert ex.prompt == "1 2 + 3 4 =" and task.answer(ex) == "4 6"
    assert ex.fields == {"a": 12, "op": "+", "b": 34, "answer": 46}
    assert spaced(-105) == "- 1 0 5"
    neg = ArithmeticTask(ops=["-"], num_eval=4)._example((3, "-", 45))
    assert neg.prompt == "3 - 4 5 =" and neg.fields["answer"] == -42
    assert ArithmeticTask(ops=["-"], num_eval=4).is_correct(neg, "- 4 2")


def test_rewards_by_hand():
    exact = ArithmeticTask(num_eval=4, reward="exact")
    partial = ArithmeticTask(num_eval=4, reward="partial")
    ex = exact._example((58, "+", 67))                     # 125
    assert exact.reward(ex, "1 2 5") == partial.reward(ex, "1 2 5") == 1.0
    assert exact.reward(ex, "1 3 5") == 0.0
    assert partial.reward(ex, "1 3 5") == pytest.approx(0.5 * 2 / 3)   # 1 and 5 in place
    assert partial.reward(ex, "2 5") == pytest.approx(0.5 * 2 / 3)     # units-aligned
    assert partial.reward(ex, "9 9 9 9") == 0.0
    assert partial.reward(ex, "x") == 0.0
    assert digit_credit(125, -125) == 0.0 and digit_credit(-5, -5) == 1.0


def test_splits_are_disjoint_and_deterministic():
    a, b = ArithmeticTask(num_eval=100), ArithmeticTask(num_eval=100)
    key = lambda exs: [(e.fields["a"], e.fields["op"], e.fields["b"]) for e in exs]  # noqa: E731
    ev, tr = key(a.eval_examples()), key(a.train_examples())
    assert len(set(ev)) == 100 and len(ev) + len(tr) == 10_000 and not set(ev) & set(tr)
    assert ev == key(b.eval_examples()) and tr == key(b.train_examples())
    assert ev != key(ArithmeticTask(num_eval=100, seed=7).eval_examples())
    big = ArithmeticTask(num_digits=4, ops=["*"], num_eval=50, max_train=300)
    assert len(big.train_examples()) == 300
    assert not set(key(big.eval_examples())) & set(key(big.train_examples()))


def test_word_subtraction_splits_share_no_problem():
    """Words style asks a - b with a < b as b - a, so (3, '-', 5) and (5, '-', 3) are one
    problem: 1-digit operands give 10 * 11 / 2 = 55 of them, split without overlap."""
    task = ArithmeticTask(style="words", ops=["-"], num_digits=1, num_eval=10)
    key = lambda exs: [(e.fields["a"], e.fields["b"]) for e in exs]  # noqa: E731
    ev, tr = key(task.eval_examples()), key(task.train_examples())
    assert len(ev) == 10 and len(tr) == 45 and len(set(ev + tr)) == 55
    assert all(a >= b for a, b in ev + tr)


def test_word_problems_are_the_same_in_every_process():
    code = ("from rlctl.tasks.arithmetic import ArithmeticTask as T;"
            "print([e.prompt for e in T(style='words', ops=['+','-','*'], num_eval=6).eval_examples()])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(s))).stdout for s in (1, 2)}
    assert len(outs) == 1 and "?" in outs.pop()
    task = ArithmeticTask(style="words", ops=["-"], num_eval=20)
    for ex in task.eval_examples():
        assert ex.fields["answer"] >= 0                       # nothing taken beyond what is there
        assert task.answer(ex) == str(ex.fields["answer"])
        assert task.is_correct(ex, f"So the answer is \\boxed{{{ex.fields['answer']}}}.")


@pytest.mark.parametrize("kw, msg", [
    (dict(ops=["/"]), r"invalid task.ops \['/'\]; each must be one of \+, -, \*"),
    (dict(style="prose"), r"invalid task.style 'prose'; valid: symbolic, words"),
    (dict(reward="positional"), r"invalid task.reward 'positional' for arithmetic; valid: exact, strict, strict_shaped, equation, equation_shaped, partial"),
    (dict(num_digits=0), r"invalid task.num_digits '0'"),
    (dict(num_digits=1, num_eval=500), r"invalid task.num_eval '500'; must be in \[0, 99\]"),
    (dict(train_path="x.jsonl"), r"task.train_path does not apply to task 'arithmetic'"),
    (dict(num_digits=None), r"task.num_digits must be set for task 'arithmetic'"),
])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        build_task("arithmetic", **kw)


def test_compose_defaults_and_the_tiny_warmup_key():
    from rlctl.config.compose import compose
    from rlctl.demo.tiny import build_params, cache_key, resolve_warmup_task

    from omegaconf import OmegaConf

    from rlctl.train.build import task_from_config

    cfg = compose(["task=arithmetic"]).cfg
    OmegaConf.resolve(cfg)
    assert cfg.model.warmup_task == "arithmetic" and list(cfg.task.ops) == ["+"]
    task = task_from_config(cfg).task      # as train/eval/rollout build it
    assert task.num_digits == 2 and task.style == "symbolic" and len(task.eval_examples()) == 256
    assert compose([]).cfg.model.warmup_task == "sorting"
    assert resolve_warmup_task("jsonl") == "sorting" == resolve_warmup_task("sorting")
    with pytest.raises(ValueError, match="invalid model.warmup_task 'sortng'"):
        resolve_warmup_task("sortng")
    sort, arith = build_params(warmup_steps=80), build_params(warmup_steps=80, warmup_task="arithmetic")
    assert "warmup_task" not in sort                   # sorting models keep their cache keys
    assert cache_key(sort) != cache_key(arith) and arith["warmup_task"] == "arithmetic"


def test_strict_rewards_score_the_whole_answer():
    strict = ArithmeticTask(num_eval=4, style="words", reward="strict")
    shaped = ArithmeticTask(num_eval=4, style="words", reward="strict_shaped")
    ex = strict._example((58, "+", 67))                    # 125
    for text in ("125", " 125.\n", "125 ."):
        assert strict.reward(ex, text) == shaped.reward(ex, text) == 1.0
        assert strict.is_correct(ex, text) and shaped.is_correct(ex, text)
    for text in ("The answer is 125.", "58 + 67 = 125", "125. 125.", "1 2 5"):   # right, not alone
        assert strict.reward(ex, text) == 0.0 and shaped.reward(ex, text) == 0.5, text
        assert not strict.is_correct(ex, text) and not shaped.is_correct(ex, text)
    for text in ("The answer is 124.", "", None):
        assert strict.reward(ex, text) == shaped.reward(ex, text) == 0.0, text
        assert not strict.is_correct(ex, text)
    assert strict.reward(ex, "124") == 0.0 and shaped.reward(ex, "124.") == 0.2
    assert shaped.reward(ex, "-3") == 0.2 and not shaped.is_correct(ex, "124")
    assert ArithmeticTask(num_eval=4).is_correct(ex, "58 + 67 = 125")      # exact: lenient
    assert strict.score_all(ex, "So 125") == {"exact": 1.0, "strict": 0.0, "strict_shaped": 0.5,
                                              "equation": 0.0, "equation_shaped": 0.5,
                                              "partial": 1.0}


def test_shaped_max_pays_no_partial_credit_for_naming_the_smaller_number():
    # a learned hack: "25 is larger than 67." ends in the right number; restating both numbers
    # must not earn the 0.5 for the right number in other text
    shaped = ArithmeticTask(num_eval=4, style="words", ops=["max"], reward="strict_shaped")
    ex, tie = shaped._example((25, "max", 67)), shaped._example((7, "max", 7))
    cases = [("67", 1.0), ("67.", 1.0), ("The larger number is 67.", 0.5),
             ("25 is larger than 67.", 0.0), ("67 is larger than 25.", 0.0), ("25", 0.2),
             ("Not 125 but 67", 0.5),                 # 125 is no operand; the final 67 is right
             ("It is 67, not 250.", 0.0)]             # the final number is wrong
    for text, want in cases:
        assert shaped.reward(ex, text) == want, text
    assert shaped.reward(tie, "7 is as large as 7.") == 0.5      # a tie names no smaller number
    # numbers are read whole, as the answer is: the right number written "60.0" or "1,000"
    # does not name a smaller 0 or 1, and "-25" or "25.0" still names 25
    zero, one = shaped._example((60, "max", 0)), shaped._example((1000, "max", 1))
    assert shaped.reward(zero, "The larger is 60.0") == 0.5
    assert shaped.reward(one, "The larger is 1,000.") == 0.5
    assert shaped.reward(one, "1,000 beats 1.") == 0.0
    assert shaped.reward(ex, "67, not -25.0") == 0.0


def test_equation_rewards_score_the_whole_equation():
    task = build_task("arithmetic", style="words", ops=["+", "-", "*"], num_eval=4,
                      reward="equation", prompt_format="chat")
    shaped = ArithmeticTask(num_eval=4, style="words", ops=["+", "-", "*"], reward="equation_shaped")
    add, sub, mul = (task._example(p) for p in ((58, "+", 67), (9, "-", 4), (3, "*", 4)))
    assert add.prompt.endswith("Answer with one equation and its result, like 2 + 3 = 5.")
    right = [(add, "58 + 67 = 125"), (add, " 67+58=125.\n"), (sub, "9 - 4 = 5"),
             (mul, "3 * 4 = 12"), (mul, "4 x 3 = 12"), (mul, "3 × 4 = 12")]
    for ex, text in right:                                 # + and * either way round
        assert task.reward(ex, text) == shaped.reward(ex, text) == 1.0, text
        assert task.is_correct(ex, text)
    # the right number in other text 0.5; the problem's equation, wrong result 0.2; else 0
    cases = [(add, "125", 0.5), (add, "So 58 + 67 = 125 coins", 0.5), (add, "58 + 67 = 124", 0.2),
             (add, "67 + 58 = 15", 0.2), (sub, "4 - 9 = -5", 0.0), (sub, "9 + 4 = 13", 0.0),
             (add, "2 + 3 = 5", 0.0), (add, "58 + 66 = 124", 0.0), (add, "", 0.0), (add, None, 0.0),
             (sub, "4 - 9 = 5", 0.5)]      # not the problem's equation (order), the right number
    for ex, text, want in cases:
        assert task.reward(ex, text) == 0.0 and shaped.reward(ex, text) == want, text
        assert not task.is_correct(ex, text)
    # as written: no leading zeros, one line, at most 31 digits (never int() of 5000 digits)
    for text in ("058 + 67 = 125", "58 + 67 = 0125", "58\n+\n67\n=\n125", "58 + 67 = " + "9" * 5000):
        assert task.reward(add, text) == 0.0 and not task.is_correct(add, text)
    mixed = build_task("arithmetic", style="words", ops=["+", "max"], num_eval=8, prompt_format="chat")
    keys = {frozenset(mixed.score_all(ex, "12")) for ex in mixed.eval_examples()}
    assert keys == {frozenset(mixed.reward_names())} and "equation" not in mixed.reward_names()
    with pytest.raises(ValueError, match="needs task.prompt_format=chat"):
        build_task("arithmetic", style="words", num_eval=4, reward="equation").eval_examples()
    for ex in (add, sub, mul):                            # the warm-up's answer scores 1
        assert task.reward(ex, task.answer(ex)) == 1.0
    with pytest.raises(ValueError, match="no equation for op 'max'"):
        ArithmeticTask(num_eval=4, style="words", ops=["max"], reward="equation")


def test_max_asks_which_number_is_larger_in_words():
    task = build_task("arithmetic", style="words", ops=["max"], num_eval=8, prompt_format="chat")
    for ex in task.eval_examples() + task.train_examples()[:50]:
        f = ex.fields
        assert f["answer"] == max(f["a"], f["b"]) and str(f["a"]) in ex.prompt
        assert ex.prompt.endswith("Answer with just the number.") and "larger" in ex.prompt
        assert task.reward(ex, task.answer(ex)) == 1.0
    with pytest.raises(ValueError, match="'max' needs task.style=words"):
        ArithmeticTask(ops=["max"], num_eval=4)
