"""The built-in environments played with scripted turns (no model): observations and
rewards checked by hand, the registries, the splits, and bad task options."""
import subprocess
import sys

import pytest

from rlctl.envs.environment import ENVS, is_episodic
from rlctl.envs.builtin import guess_example, product_example, sum_example
from rlctl.tasks.task import ENV_TASKS as BUILTIN_ENVS
from rlctl.envs.calc import TINY_AGENT_WORDS
from rlctl.tasks import TASKS, build_task
from rlctl.types import Turn

COMMON = dict(prompt_format="raw", reward_timeout_s=60, on_reward_error="zero")


def small(name, **opts):
    """The task with fewer training rows (max_train) where it has many: the episodes do
    not depend on them, and the build is 10x quicker."""
    if name != "guess_number":
        opts.setdefault("max_train", 200)
    return build_task(name, **{"num_eval": 3, **opts}, **COMMON)


def play(env, example, turns):
    """(first observation, [(observation, reward, done, info) per turn])."""
    first = env.reset(example, seed=0)
    return first, [_step(env, t) for t in turns]


def _step(env, text):
    s = env.step(Turn(text, []))
    return s.observation, s.reward, s.done, s.info


def test_registered_as_environments_and_tasks():
    assert ENVS.names() == sorted(BUILTIN_ENVS)
    for name in BUILTIN_ENVS:
        assert name in TASKS and is_episodic(small(name))


def test_calculator_episode_with_the_tool():
    env = small("calculator").make_env()
    first, steps = play(env, product_example(123, 45),
                        ["<call> calc 1 2 3 * 4 5 </call>", "5 5 3 5"])
    assert first == "1 2 3 * 4 5 ="
    assert steps[0] == ("<result> 5 5 3 5 </result>", 0.0, False,
                        {"tool_calls": 1, "tool_errors": 0, "stop": ["</call>"]})
    assert steps[1] == (None, 1.0, True, {"success": True, "tool_calls": 0, "tool_errors": 0})
    assert env.stop == ["</call>"]
    _, (direct,) = play(env, product_example(123, 45), ["5 5 3 6"])
    assert direct[:3] == (None, 0.0, True) and direct[3]["success"] is False


def test_calculator_failed_calls_and_the_call_limit():
    env = small("calculator", max_tool_calls=2).make_env()
    _, steps = play(env, product_example(123, 45),
                    ["<call> abacus 1 </call>", "<call> calc 1 2 3 / 4 5 </call>",
                     "<call> calc 1 2 3 * 4 5 </call>"])
    for obs, reward, done, info in steps[:2]:
        assert (obs, reward, done, info["tool_calls"], info["tool_errors"]) == \
            ("<result> error </result>", 0.0, False, 1, 1)
    assert "unknown tool 'abacus'" in steps[0][3]["error"]
    assert "calc: ValueError" in steps[1][3]["error"]
    assert steps[2][:3] == (None, 0.0, True) and steps[2][3]["tool_limit"] is True   # third call not run
    _, (bad,) = play(env, product_example(123, 45), ["<call> calc 1 2"])
    assert bad[0] == "<result> error </result>" and "malformed call" in bad[3]["error"]


def test_calculator_without_tools_and_with_json_calls():
    env = small("calculator", use_tools=False).make_env()
    _, (call,) = play(env, product_example(123, 45), ["<call> calc 1 2 3 * 4 5 </call>"])
    assert call[:3] == (None, 0.0, True) and env.stop == []
    _, (direct,) = play(env, product_example(123, 45), ["5 5 3 5"])
    assert direct[:3] == (None, 1.0, True)
    env = small("calculator", tool_parser="json").make_env()
    _, steps = play(env, product_example(999, 99), [
        '<tool_call>{"name": "calc", "arguments": {"expression": "999*99"}}</tool_call>', "98901"])
    assert steps[0][0] == "<result> 9 8 9 0 1 </result>" and steps[0][3]["stop"] == ["</tool_call>"]
    assert steps[1][:3] == (None, 1.0, True)                        # 999 * 99 = 98901


def test_guess_number_episode():
    env = small("guess_number").make_env()
    first, steps = play(env, guess_example(11, 16), ["8", "1 2", "1 0", "x", "1 1"])
    assert first == "guess 1 6 :"
    assert [s[:3] for s in steps] == [("higher", 0.0, False), ("lower", 0.0, False),
                                      ("higher", 0.0, False), ("error", 0.0, False),
                                      (None, 1.0, True)]
    assert steps[-1][3] == {"success": True}


def test_running_sum_rewards_every_turn():
    env = small("running_sum").make_env()
    first, steps = play(env, sum_example(3, (4, 2, 5)), ["7", "8", "1 4"])
    assert first == "sum 3 + 4 ="
    # 3 + 4 = 7 (right); + 2 = 9, answered 8 (wrong); + 5 = 14 (right, from the true 9)
    assert [s[:3] for s in steps] == [("+ 2 =", 1.0, False), ("+ 5 =", 0.0, False), (None, 1.0, True)]
    assert steps[-1][3] == {"success": False, "correct": 2}
    _, steps = play(env, sum_example(9, (9, 9, 9)), ["1 8", "2 7", "3 6"])
    assert [s[1] for s in steps] == [1.0, 1.0, 1.0] and steps[-1][3]["success"] is True


def _words(text):
    return {w for w in text.split() if not (w.isdigit() or w in "=+-*:")}


def test_every_word_written_is_in_the_vocabulary():
    env = small("calculator").make_env()
    seen = _words(env.reset(product_example(123, 45), 0))
    seen |= _words(env.step(Turn("<call> calc 1 </call>", [])).observation)
    seen |= _words(env.step(Turn("<call> nope </call>", [])).observation)
    seen |= {"<call>", "</call>", "calc"}
    genv = small("guess_number").make_env()
    seen |= _words(genv.reset(guess_example(5, 16), 0))
    seen |= {genv.step(Turn(t, [])).observation for t in ("1", "9", "x")}
    renv = small("running_sum").make_env()
    seen |= _words(renv.reset(sum_example(1, (2, 3, 4)), 0) + renv.step(Turn("3", [])).observation)
    assert seen == set(TINY_AGENT_WORDS)


@pytest.mark.parametrize("name, opts", [("calculator", {}), ("running_sum", {})])
def test_splits_never_overlap_and_follow_the_seed(name, opts):
    def rows(task):
        return [tuple(sorted((k, str(v)) for k, v in ex.fields.items())) for ex in task]
    a = build_task(name, num_eval=4, seed=1, **opts, **COMMON)
    train, held = rows(a.train_examples()), rows(a.eval_examples())
    assert len(held) == len(set(held)) == 4 and not set(train) & set(held)
    assert len(train) == len(set(train)) >= 4
    again = build_task(name, num_eval=4, seed=1, **opts, **COMMON)
    assert rows(again.eval_examples()) == held and rows(again.train_examples()) == train
    other = build_task(name, num_eval=4, seed=2, **opts, **COMMON)
    assert rows(other.eval_examples()) != held


def _secrets(rows):
    return [ex.fields["secret"] for ex in rows]


@pytest.mark.parametrize("n", [16, 8])
def test_guess_number_trains_and_evals_on_every_secret(n):
    """No split by secret (the env's docstring): training has each of 1..N once; eval
    goes through the same seeded order, num_eval rows (N: each secret once)."""
    task = build_task("guess_number", max_number=n, num_eval=n, seed=1, **COMMON)
    train, held = _secrets(task.train_examples()), _secrets(task.eval_examples())
    assert sorted(train) == list(range(1, n + 1)) and held == train
    assert {ex.prompt for ex in task.train_examples() + task.eval_examples()} == \
        {"guess 1 6 :" if n == 16 else "guess 8 :"}
    twice = _secrets(build_task("guess_number", max_number=n, num_eval=2 * n + 3, seed=1,
                                **COMMON).eval_examples())
    assert twice == train + train + train[:3]
    other = _secrets(build_task("guess_number", max_number=n, num_eval=n, seed=2,
                                **COMMON).train_examples())
    assert sorted(other) == list(range(1, n + 1)) and other != train    # the seed: the order


@pytest.mark.parametrize("name, opts, message", [
    ("guess_number", {"max_number": 1}, "task.max_number must be an integer >= 2, got 1"),
    ("guess_number", {"num_eval": 1601}, "task.num_eval must be an integer in [0, 1600], got 1601"),
    ("guess_number", {"max_number": 4, "num_eval": -1}, "task.num_eval must be an integer in [0, 400], got -1"),
    ("guess_number", {"use_tools": True}, "task.use_tools does not apply to task 'guess_number'"),
    ("calculator", {"tool_parser": "xml"}, "task.tool_parser: unknown tool-call parser 'xml'; valid: json, tag"),
    ("calculator", {"sandbox": "docker"}, "invalid task.sandbox 'docker'; valid: none, subprocess"),
    ("calculator", {"max_tool_calls": 0}, "task.max_tool_calls must be an integer >= 1, got 0"),
    ("calculator", {"use_tools": "yes"}, "task.use_tools must be true or false, got 'yes'"),
    ("calculator", {"tool_timeout_s": 0}, "task.tool_timeout_s must be > 0 seconds, got 0"),
    ("calculator", {"tool_memory_gb": 0.01}, "task.tool_memory_gb must be >= 0.05 (GB), got 0.01"),
    ("running_sum", {"num_additions": 0}, "task.num_additions must be an integer in [1, 12], got 0"),
])
def test_bad_options_are_one_line(name, opts, message):
    with pytest.raises(ValueError) as exc:
        build_task(name, **opts, **COMMON)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_other_tasks_import_no_environment_and_env_tasks_build_on_demand():
    """rlctl.tasks and rlctl.envs.environment import no built-in environment, tool, sandbox or data
    task; the registry's deferred entries import them when built, with the factory's options."""
    code = ("import inspect, sys\nimport rlctl.tasks, rlctl.envs.environment\n"
            "from rlctl.tasks import TASKS, build_task\n"
            "held = sorted(m for m in sys.modules if m.startswith(('rlctl.envs.', 'rlctl.tasks.data')))\n"
            "params = list(inspect.signature(TASKS.get('guess_number')).parameters)\n"
            "task = build_task('guess_number', num_eval=2)\n"
            "print(held, params, 'rlctl.envs.tools' in sys.modules, len(task.eval_examples()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "['rlctl.envs.environment'] ['max_number', 'num_eval', 'seed'] True 2"
