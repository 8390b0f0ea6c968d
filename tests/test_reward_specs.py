"""Reward specs on the command line without inner quotes: ``task.rewards=[r.py:f,g.py:h]``,
a lone ``task.rewards=r.py:f`` and a ``~/`` path (which Hydra's grammar rejects unquoted)."""
import json

import pytest

from rlctl.config.compose import compose
from rlctl.errors import ConfigError

DATA = ["task=jsonl", "task.train_path=d.jsonl"]


@pytest.mark.parametrize("override, rewards", [
    ("task.rewards=[r.py:f,sub/g.py:h]", ["r.py:f", "sub/g.py:h"]),
    ("task.rewards=r.py:f", ["r.py:f"]),
    ("task.rewards=[~/r.py:f, r.py:g]", ["~/r.py:f", "r.py:g"]),
    ('task.rewards=["r.py:f"]', ["r.py:f"]),
    ("task.rewards=[{fn:r.py:f,weight:0}]", [{"fn": "r.py:f", "weight": 0}]),
    ("task.rewards=null", None),
])
def test_unquoted_reward_specs_compose(override, rewards):
    cfg = compose([*DATA, override]).cfg
    got = cfg.task.rewards
    assert (None if got is None else [x if isinstance(x, str) else dict(x) for x in got]) == rewards


def test_reward_fn_with_a_home_path_composes():
    assert compose([*DATA, "task.reward_fn=~/r.py:f"]).cfg.task.reward_fn == "~/r.py:f"


def test_a_bad_reward_override_is_one_grammar_error():
    with pytest.raises(ConfigError, match=r"cannot parse 'task.rewards=\[a\"b'\]'"):
        compose([*DATA, "task.rewards=[a\"b']"])


def test_cli_rollout_takes_unquoted_specs(tmp_path, rlctl_app):
    (tmp_path / "r.py").write_text("def right(prompt, completion, **f):\n    return 1.0\n\n"
                                   "def fmt(prompt, completion, **f):\n    return 0.5\n")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{i} 1 ="}) + "\n"
                                              for i in range(4)))
    res = rlctl_app("rollout", *DATA, "task.num_eval=1", "rollout.max_new_tokens=2",
                    "task.rewards=[~/r.py:right,r.py:fmt]", "--out", "o.jsonl", "--prompts", "1",
                    "--samples", "2", cwd=tmp_path, env={"HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["rewards"] for r in rows] == [{"right": 1.0, "fmt": 0.5}] * 2
