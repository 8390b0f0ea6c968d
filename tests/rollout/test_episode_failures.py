"""Environments that fail, played by the episode loop on a tiny random-init Llama: nothing
silent, nothing that hangs. A huge observation is cut before it is tokenized; a close()
that blocks is bounded by the step time limit; text that is not valid Unicode is
repaired; bad info fields, raising steps and gym's 4-tuple are counted env errors, each
kind said once in one line naming the environment and the call; a batch whose steps
mostly fail is said; SIGTERM stops a run whose environments never close, with a
checkpoint. Every bound on time is a join or a subprocess timeout."""
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from episode_runs import player_settings

from rlctl.demo.tiny import build_model, build_tokenizer
from rlctl.envs.environment import EnvTask
from rlctl.rollout.episodes.loop import EpisodePlayer
from rlctl.types import OBSERVATION, TURN_LIMIT, Example, Step

ROWS = [Example("1 2 +")]
RELEASE = threading.Event()         # what a blocking close() waits on (set at the module's end)
LOOP_LOG = "rlctl.rollout.episodes.loop"


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    yield build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).eval(), tok
    RELEASE.set()


class Recording:
    """The tokenizer, recording the longest text it was asked to encode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, *args, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tok(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def play(tiny, make_env, tok=None, group_size=2, **settings):
    model, tiny_tok = tiny
    tok = tok or tiny_tok
    s = player_settings(**{"group_size": group_size, "max_new_tokens": 2, "temperature": 1.0,
                           "max_turns": 2, "max_tokens": 40, **settings})
    torch.manual_seed(0)
    return EpisodePlayer(tok, EnvTask("failing", make_env, ROWS, ROWS), *s,
                         (tiny_tok.eos_token_id,)).play(model, ROWS, seed=0)


def said(caplog, *words):
    return [r.getMessage() for r in caplog.records if all(w in r.getMessage() for w in words)]


class Huge:
    def reset(self, example, seed):
        return example.prompt

    def step(self, turn):
        return Step("1 2 3 " * 1_000_000, 0.0, False, {})      # 6 MB of text


def test_a_huge_observation_is_cut_before_it_is_tokenized(tiny):
    """6 MB of text, max_obs_tokens=3: the tokenizer sees a bounded prefix (tokenizing the
    whole takes seconds per episode), and the span keeps only the text of the kept tokens."""
    tok = Recording(tiny[1])
    t0 = time.perf_counter()
    batch = play(tiny, Huge, tok=tok, max_obs_tokens=3, max_turns=2)
    assert time.perf_counter() - t0 < 5.0
    assert tok.longest < 10_000, tok.longest
    for e in batch.episodes.records:
        obs = [s for s in e.spans if s.role == OBSERVATION]
        assert len(obs) == 1 and obs[0].truncated and obs[0].text == "1 2 3"


class BlocksOnClose(Huge):
    def step(self, turn):
        return Step("1", 0.0, False, {})

    def close(self):
        RELEASE.wait()


class RaisesOnClose(BlocksOnClose):
    def close(self):
        raise RuntimeError("close\nboom")


@pytest.mark.parametrize("env, why", [(BlocksOnClose, "no answer within 0.3 s"),
                                      (RaisesOnClose, "raised RuntimeError: close boom")])
def test_a_close_that_blocks_or_raises_is_bounded_counted_and_said_once(tiny, caplog, env, why):
    out = {}
    with caplog.at_level(logging.WARNING, logger=LOOP_LOG):
        worker = threading.Thread(target=lambda: out.update(batch=play(
            tiny, env, step_timeout_s=0.3)), daemon=True)
        worker.start()
        worker.join(timeout=30)
    assert not worker.is_alive(), "play() hangs on close()"
    assert [e.env_errors for e in out["batch"].episodes.records] == [1, 1]
    lines = said(caplog, env.__name__, "close()")
    assert len(lines) == 1 and why in lines[0], caplog.text


class Surrogates(Huge):
    def reset(self, example, seed):
        return example.prompt + " \ud800"

    def step(self, turn):
        return Step("4 \udcff 5", 0.0, False, {})


def test_text_that_is_not_valid_unicode_is_repaired_not_a_crash(tiny):
    batch = play(tiny, Surrogates)
    for e in batch.episodes.records:
        assert [s.text for s in e.spans if s.role == OBSERVATION] == ["4 ? 5"]
        assert e.env_errors == 0
    assert all(p.endswith("?") for p in batch.prompts)


class BadInfo(Huge):
    def __init__(self, info):
        self.info = info

    def step(self, turn):
        return Step("1", 1.0, False, dict(self.info))


@pytest.mark.parametrize("info, field", [({"tool_calls": "two"}, "tool_calls"),
                                         ({"tool_errors": -1}, "tool_errors"),
                                         ({"stop": 5}, "stop")])
def test_a_bad_info_field_is_an_env_error_naming_it(tiny, caplog, info, field):
    with caplog.at_level(logging.WARNING, logger=LOOP_LOG):
        batch = play(tiny, lambda: BadInfo(info))
    for e in batch.episodes.records:          # 2 turns, each step's field ignored and counted
        assert e.env_errors == 2 and e.status == TURN_LIMIT and e.turn_rewards == [1.0, 1.0]
        assert e.tool_calls == 0
    assert len(said(caplog, "BadInfo", f"info['{field}']")) == 1, caplog.text


class Gym(Huge):
    def step(self, turn):
        return "1", 1.0, True, {}


class Raises(Huge):
    def step(self, turn):
        raise KeyError("no such room")


@pytest.mark.parametrize("env, words", [(Gym, ("Gym", "step()", "4-tuple", "Step(")),
                                        (Raises, ("Raises", "step()", "KeyError", "no such room"))])
def test_failing_steps_are_said_once_and_a_failing_batch_is_said(tiny, caplog, env, words):
    with caplog.at_level(logging.WARNING, logger=LOOP_LOG):
        batch = play(tiny, env, group_size=3)
    assert [e.env_errors for e in batch.episodes.records] == [2] * 3
    assert len(said(caplog, *words)) == 1, caplog.text
    assert len(said(caplog, "6 of 6 environment steps", "failed")) == 1, caplog.text


def test_a_batch_whose_steps_mostly_succeed_says_nothing(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger=LOOP_LOG):
        play(tiny, lambda: BadInfo({}))
    assert not said(caplog, "environment"), caplog.text


CLOSE_BLOCKS = '''
import time
from rlctl.envs.environment import EnvTask
from rlctl.types import Example, Step


class Blocks:
    def reset(self, example, seed):
        return example.prompt

    def step(self, turn):
        return Step("1 +", 0.0, False, {})

    def close(self):
        time.sleep(3600)


def make_task(**options):
    rows = [Example(f"{s} +") for s in range(1, 6)]
    return EnvTask("blocks", Blocks, train=rows[:4], eval=rows[4:])
'''


def test_sigterm_stops_a_run_whose_environments_never_close(tmp_path):
    """`rlctl train` in a subprocess: each close() is abandoned after 0.3 s (said once);
    SIGTERM after the first step stops the run with a checkpoint (exit 128 + 15)."""
    (tmp_path / "blocks_env.py").write_text(CLOSE_BLOCKS)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get(
        "PYTHONPATH", str(Path(__file__).resolve().parents[2]))])}
    args = [sys.executable, "-m", "rlctl.cli", "train", "task=guess_number",
            "task.name=blocks_env:make_task", "task.max_number=null", "model.warmup_task=sorting",
            "trainer.steps=1000", "trainer.eval_every=0", "trainer.prompts_per_step=1",
            "algo.group_size=2", "rollout.max_new_tokens=2", "rollout.episode.max_turns=2",
            "rollout.episode.step_timeout_s=0.3", "logger=jsonl", "logger.console=false",
            f"run.dir={run}"]
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, log = time.monotonic() + 120, run / "metrics.jsonl"
        while not (log.is_file() and '"step": 1' in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "no first step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "checkpoint saved" in err and list(run.glob("checkpoints/*")), err
    assert err.count("Blocks: close()") == 1, err
