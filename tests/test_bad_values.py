"""Every value of the config schema that cannot work is refused in one line.

The general walk goes over ``dataclasses.fields`` of the schema (recursively) in-process:
the default config is composed once, each bad value is assigned into a copy the way
Hydra applies an override, and the copy goes through ``validate`` (range and finiteness
checks) or the compose error translation (wrong types). A few cases go through
``compose`` itself, and the file / CUDA / data cases through the console script as a
user runs it (exit code 2, one line on stderr, no traceback, no run directory).
"""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.config.compose import explain as _explain
from rlctl.config.checks import CHOICES, FREE_NUMBERS, RANGES, example_value, range_problem, validate
from rlctl.core.advantages import REINFORCE_BASELINES
from rlctl.core.losses import KL_PLACEMENTS
from rlctl.core.rollout_correction import CORRECTION_LEVELS, CORRECTION_MODES
from rlctl.core.turns import TURN_REWARD_RULES
from rlctl.errors import ConfigError
from rlctl.rollout.generate import SAMPLE_DTYPES
from rlctl.rollout.engines.kinds import KINDS
from rlctl.config.schema import RLConfig, schema_fields
from rlctl.sinks.wandb_sink import MODES

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
SPECS = schema_fields()
NUMERIC = [s for s in SPECS if s.kind in ("float", "int") or (s.kind == "list" and s.item == "float")]
FLOATS = [s for s in SPECS if s.kind == "float"]
BOOLS = [s for s in SPECS if s.kind == "bool"]
# Written out by hand (not derived from the code) for the type words in the messages.
TYPE_WORDS = {"float": "a float", "int": "an integer", "bool": "a boolean", "list": "a list"}


@pytest.fixture(scope="module")
def default_cfg():
    return compose([]).cfg


def _assign(cfg, key, value):
    """A copy of cfg with key=value, set the way Hydra applies an override."""
    cfg = cfg.copy()
    OmegaConf.update(cfg, key, value, merge=True)
    return cfg


def _refusal(cfg, key, value, text):
    """The one-line message for key=value (assignment or validation), or None."""
    try:
        validate(_assign(cfg, key, value))
    except ConfigError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - OmegaConf's own type errors
        return _explain(exc, [f"{key}={text}"])
    return None


def _one_line(msg, *fragments):
    assert msg is not None and "\n" not in msg and "Traceback" not in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)


# -- the schema walk ------------------------------------------------------------------

def test_the_walk_sees_the_whole_schema():
    """Independent count: the leaf keys of OmegaConf's own view of the schema."""
    def leaves(node, prefix=""):
        out = []
        for k in node:
            if k == "defaults":
                continue
            child = node._get_node(k)
            out += leaves(child, f"{prefix}{k}.") if OmegaConf.is_dict(child) else [prefix + k]
        return out
    walked = {s.key for s in SPECS if s.kind != "group"}
    assert walked == set(leaves(OmegaConf.structured(RLConfig)))
    assert {"trainer.async_rollout.num_actors", "algo.kl.horizon", "model.lora.lr"} <= walked
    assert len(FLOATS) >= 20 and len(BOOLS) >= 10


def test_every_numeric_key_has_a_declared_range():
    keys = {s.key for s in NUMERIC}
    assert set(RANGES) <= keys, set(RANGES) - keys          # no stale table entries
    assert keys - set(RANGES) == set(FREE_NUMBERS), keys - set(RANGES) - set(FREE_NUMBERS)


def test_every_choice_key_is_refused_outside_its_choices_and_they_match_their_owners(default_cfg):
    """The schema's choices (what compose checks, with no torch) are the owning modules' sets."""
    owners = {"algo.kl.placement": KL_PLACEMENTS, "algo.baseline": REINFORCE_BASELINES,
              "algo.rollout_correction.level": CORRECTION_LEVELS,
              "algo.rollout_correction.mode": CORRECTION_MODES,
              "rollout.episode.turn_reward": TURN_REWARD_RULES, "rollout.sample_dtype": SAMPLE_DTYPES,
              "rollout.server.kind": tuple(KINDS), "logger.wandb_mode": MODES}
    for key, valid in owners.items():
        assert set(CHOICES[key]) == set(valid), key
    for key, valid in CHOICES.items():
        bad = 7 if all(isinstance(v, int) for v in valid) else "bogus"
        _one_line(_refusal(default_cfg, key, bad, str(bad)),
                  f"invalid {key} '{bad}'; valid: {', '.join(map(str, valid))}")


@pytest.mark.parametrize("spec", FLOATS, ids=[s.key for s in FLOATS])
def test_every_float_key_rejects_nan_and_inf(default_cfg, spec):
    for value, text in ((math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")):
        msg = _refusal(default_cfg, spec.key, value, text)
        _one_line(msg, f"invalid {spec.key} '{text}'; must be")


def _outside(spec):
    """Values just outside the key's declared range (ints step by 1, floats by 0.5)."""
    rng = RANGES[spec.key]
    is_int = (spec.item if spec.kind == "list" else spec.kind) == "int"
    step = 1 if is_int else 0.5
    out = []
    if rng.lo is not None:
        out.append(rng.lo if rng.lo_open else rng.lo - step)
    if rng.hi is not None:
        out.append(rng.hi if rng.hi_open else rng.hi + step)
    return [int(v) if is_int else float(v) for v in out]


RANGED = [s for s in NUMERIC if s.key in RANGES]


@pytest.mark.parametrize("spec", RANGED, ids=[s.key for s in RANGED])
def test_every_ranged_key_refuses_values_outside_and_names_the_range(default_cfg, spec):
    for bad in _outside(spec):
        value = [bad, 0.999] if spec.kind == "list" else bad
        msg = _refusal(default_cfg, spec.key, value, str(bad))
        _one_line(msg, f"invalid {spec.key} ", f"must be {RANGES[spec.key].describe()}")
    # the example the messages suggest is itself accepted by the range check
    example = OmegaConf.to_container(OmegaConf.from_dotlist([f"x={example_value(spec)}"]))["x"]
    for item in (example if spec.kind == "list" else [example]):
        assert range_problem(spec, item) is None, (spec.key, example)


@pytest.mark.parametrize("key, value, expected", [
    # hand-worked: each message as a user should read it
    ("trainer.lr", 0.0, "invalid trainer.lr '0.0'; must be > 0 and finite"),
    ("trainer.lr", math.nan, "invalid trainer.lr 'nan'; must be > 0 and finite"),
    ("rollout.temperature", math.nan, "invalid rollout.temperature 'nan'; must be > 0 and finite"),
    ("rollout.temperature", 0.0, "must be > 0 and finite; sampling needs > 0"),
    ("algo.kl.coef", -0.1, "invalid algo.kl.coef '-0.1'; must be >= 0 and finite"),
    ("algo.kl.coef", math.nan, "invalid algo.kl.coef 'nan'; must be >= 0"),
    ("algo.clip_eps_high", -0.2, "invalid algo.clip_eps_high '-0.2'; must be >= 0"),
    ("algo.norm_len", 0, "invalid algo.norm_len '0'; must be >= 1"),
    ("algo.value_clip", 0.0, "invalid algo.value_clip '0.0'; must be > 0"),
    ("model.lora.lr", -1e-4, "invalid model.lora.lr '-0.0001'; must be > 0"),
    ("model.lora.dropout", 1.0, "invalid model.lora.dropout '1.0'; must be in [0, 1)"),
    ("trainer.max_bad_steps", 0, "invalid trainer.max_bad_steps '0'; must be >= 1"),
    ("trainer.betas", [0.9, 1.0], "invalid trainer.betas '[0.9, 1.0]'; must be in [0, 1)"),
    ("algo.gamma", 1.01, "invalid algo.gamma '1.01'; must be in [0, 1]"),
    ("task.correct_threshold", math.inf, "invalid task.correct_threshold 'inf'; must be a number (finite)"),
    ("seed", -1, "invalid seed '-1'; must be in [0, 2147483648)"),
])
def test_hand_worked_messages(default_cfg, key, value, expected):
    _one_line(_refusal(default_cfg, key, value, str(value)), expected)


def test_the_edges_of_a_range_are_accepted(default_cfg):
    for key, value in (("algo.kl.coef", 0.0), ("algo.gamma", 1.0), ("algo.gamma", 0.0),
                       ("model.lora.dropout", 0.0), ("trainer.max_grad_norm", 0.0),
                       ("algo.norm_len", 1), ("trainer.max_bad_steps", 1), ("task.correct_threshold", -5.0)):
        assert _refusal(default_cfg, key, value, str(value)) is None, key


NON_STR = [s for s in SPECS if s.kind in ("float", "int", "bool", "list")]


@pytest.mark.parametrize("spec", NON_STR, ids=[s.key for s in NON_STR])
def test_every_typed_key_names_the_expected_type_and_an_example(default_cfg, spec):
    bad = {"float": "abc", "int": "abc", "bool": "maybe", "list": "abc"}[spec.kind]
    msg = _refusal(default_cfg, spec.key, bad, bad)
    _one_line(msg, f"invalid value '{bad}' for '{spec.key}': expected {TYPE_WORDS[spec.kind]}",
              f"(e.g. {spec.key}=")
    if spec.kind in ("float", "int"):                 # a float is no integer, and vice versa
        wrong = 1.5 if spec.kind == "int" else {"a": 1}
        _one_line(_refusal(default_cfg, spec.key, wrong, str(wrong)), f"for '{spec.key}': expected")


# -- through compose: overrides and recipes ---------------------------------------------

@pytest.mark.parametrize("override, expected", [
    ("trainer.share_prompts=maybe", "invalid value 'maybe' for 'trainer.share_prompts': expected a "
                                    "boolean (e.g. trainer.share_prompts=true)"),
    ("algo.kl=0.1", "invalid value '0.1' for 'algo.kl': it is a group of keys (coef, estimator, "
                    "horizon, placement, target); set one of them, e.g. algo.kl.coef=..."),
    ("trainer.lr={a: 1}", "invalid value '{a: 1}' for 'trainer.lr': expected a float (e.g. trainer.lr=0.1)"),
    ("model.lora.target_modules=q_proj", "invalid value 'q_proj' for 'model.lora.target_modules': "
                                         "expected a list of strings (e.g. model.lora.target_modules=[a,b])"),
    ("seed=1.5", "invalid value '1.5' for 'seed': expected an integer (e.g. seed=1)"),
    ("algo.clip_eps=null", "invalid value 'null' for 'algo.clip_eps': expected a float (null is not allowed)"),
    ("algo.norm_len=x", "invalid value 'x' for 'algo.norm_len': expected an integer or null"),
    ("trainer.lr=nan", "invalid trainer.lr 'nan'; must be > 0 and finite"),
    ("algo.clip_eps_high=-0.1", "invalid algo.clip_eps_high '-0.1'; must be >= 0 and finite"),
    ("seed=,", "cannot parse 'seed=,' (extraneous input ',')"),
])
def test_compose_gives_one_line(override, expected):
    with pytest.raises(ConfigError) as err:
        compose([override])
    _one_line(str(err.value), expected)


def test_an_unknown_key_in_a_recipe_reads_like_the_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("# @package _global_\nalgo:\n  not_a_key: 1\n")
    with pytest.raises(ConfigError) as from_recipe:
        compose([], str(recipe))
    with pytest.raises(ConfigError) as from_override:
        compose(["algo.not_a_key=1"])
    assert str(from_recipe.value) == str(from_override.value)
    _one_line(str(from_recipe.value), "unknown config key 'algo.not_a_key'; valid keys of 'algo': ",
              "clip_eps, clip_eps_high")
    recipe.write_text("# @package _global_\ntrainer:\n  share_prompts: maybe\n")
    with pytest.raises(ConfigError) as typed:
        compose([], str(recipe))
    _one_line(str(typed.value), "invalid value 'maybe' for 'trainer.share_prompts': expected a boolean")


# -- through the console script ---------------------------------------------------------

def _run(tmp_path, *args, in_process=False):
    """The one error line of `rlctl ARGS`: through the console script (a subprocess, as a
    user runs it) or, to keep the suite fast, through the same Typer app in-process."""
    if in_process:
        from typer.testing import CliRunner

        from rlctl.cli import app
        result = CliRunner().invoke(app, [str(a) for a in args])
        code, err = result.exit_code, result.stderr
        assert isinstance(result.exception, SystemExit), result.exception
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
        out = subprocess.run([RLCTL, *map(str, args)], capture_output=True, text=True, cwd=tmp_path,
                             env=env, timeout=180)
        code, err = out.returncode, out.stderr
    lines = [ln for ln in err.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _train(tmp_path, *args, in_process=False):
    line = _run(tmp_path, "train", "trainer.steps=1", f"run.output_dir={tmp_path}/runs", *args,
                in_process=in_process)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "run dir made"
    return line


@pytest.fixture(scope="module")
def truncated_model(tmp_path_factory):
    """A saved model directory whose model.safetensors lost its tail (a copy cut short)."""
    from rlctl.demo.tiny import build_tiny

    root = tmp_path_factory.mktemp("broken_model")
    src = build_tiny(warmup_steps=0, cache_dir=root / "cache")
    model = shutil.copytree(src, root / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return model


@pytest.mark.parametrize("command", ["train", "eval", "rollout"])
def test_a_truncated_safetensors_is_named(tmp_path, truncated_model, command):
    if command == "train":
        line = _train(tmp_path, "model=hf", f"model.name_or_path={truncated_model}")
    else:
        extra = ["--out", tmp_path / "r.jsonl", "--prompts", "2"] if command == "rollout" else []
        line = _run(tmp_path, command, truncated_model, *extra, in_process=True)
    # train checks the weights' header before building (rlctl/models/hf_files.py) and names the file
    # itself; eval and rollout name the model directory
    named = f"'{truncated_model}/model.safetensors'" if command == "train" else f"'{truncated_model}'"
    _one_line(line, "cannot load model", named, "corrupt or truncated")


def test_broken_files_are_named(tmp_path):
    recipe = tmp_path / "bin.yaml"
    recipe.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    _one_line(_train(tmp_path, "--recipe", recipe, in_process=True), f"cannot read recipe '{recipe}': not UTF-8 text (byte 0x89")
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2,}}')
    _one_line(_train(tmp_path, "hardware=deepspeed", f"hardware.deepspeed_config={ds}", in_process=True),
              f"hardware.deepspeed_config '{ds}' is not valid JSON: Expecting property name")


def test_inspect_names_a_file_that_is_not_utf8(tmp_path):
    rollout = tmp_path / "roll.jsonl"
    rollout.write_bytes(b'{"reward": 1.0, "length": 3}\n\xff\xfe\x00\n')
    _one_line(_run(tmp_path, "inspect", rollout), f"cannot read '{rollout}': not UTF-8 text (byte 0xff)")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xc3\x28\n')
    _one_line(_run(tmp_path, "inspect", run, in_process=True), f"cannot read {run / 'metrics.jsonl'}: not UTF-8 text (byte 0xc3")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("args", [["hardware=gpu"], ["hardware=deepspeed", "hardware.device=cuda"]])
def test_cuda_without_cuda_is_refused_before_a_run_dir(tmp_path, args):
    line = _train(tmp_path, *args, in_process=args[0] != "hardware=gpu")
    _one_line(line, "hardware.device=cuda", "needs a CUDA GPU", "use hardware=cpu")


def test_data_rows_are_named_by_their_line_in_the_file(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": "a"} for i in range(30)]
    rows[17] = {"question": "no prompt here", "answer": "a"}
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = ["task=jsonl", f"task.train_path={data}", "task.reward_fn=exact"]
    _one_line(_train(tmp_path, *task), f"{data}:18 has no 'prompt' (task.prompt_field)")
    rows[17] = {"prompt": "1 " * 1_500_000, "answer": "a"}      # 3M characters, 1.5M words
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    _one_line(_train(tmp_path, *task, in_process=True), f"{data}:18: the prompt has 3000000 characters, more than the 1000000")


def test_a_sweep_grammar_error_is_one_line(tmp_path):
    _one_line(_run(tmp_path, "train", "-m", "seed=,", f"run.output_dir={tmp_path}/runs"),
              "cannot parse 'seed=,' (extraneous input ',')", "seed=0,1,2")
    assert not (tmp_path / "runs").exists()


def test_dataclass_fields_walk_matches_the_dataclasses():
    """schema_fields follows dataclasses.fields (every section, trainer.async_rollout included)."""
    top = [f.name for f in dataclasses.fields(RLConfig) if f.name != "defaults"]
    assert [s.key for s in SPECS if "." not in s.key] == top
