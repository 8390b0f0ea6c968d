import io
import re

import torch

from rlctl.sinks import ConsoleSink, build_sinks


def metrics(step):
    return {
        "reward/mean": 0.125 * step,
        "policy/clip_frac": 0.01 * step,
        "policy/kl_ref": 0.002,
        "length/mean": torch.tensor(6.5),
        "perf/tokens_per_s": 12345.6,
        "policy/loss": 9.99,  # not a key figure
    }


def test_non_tty_prints_compact_lines_with_key_figures():
    out = io.StringIO()  # not a TTY
    sink = ConsoleSink(total_steps=10, print_every=5, file=out)
    assert not sink.live
    sink.log({"eval/exact_match": 0.3}, step=0)
    for step in range(1, 11):
        sink.log(metrics(step), step=step)
    sink.close()
    lines = out.getvalue().splitlines()
    assert [re.match(r"step (\d+)/10", line).group(1) for line in lines] == ["0", "5", "10"]
    assert "\x1b" not in out.getvalue()  # no terminal control codes
    last = lines[-1]
    for figure in ("reward/mean 1.25", "eval/exact_match 0.3", "policy/kl_ref 0.002",
                   "policy/clip_frac 0.1", "length/mean 6.5", "perf/tokens_per_s 12346"):
        assert figure in last, (figure, last)
    assert "policy/loss" not in last
    # the order of the figures follows `keys`
    assert last.index("reward/mean") < last.index("eval/exact_match") < last.index("perf/tokens_per_s")


def test_non_tty_close_prints_the_last_unprinted_step():
    out = io.StringIO()
    sink = ConsoleSink(total_steps=100, print_every=10, file=out)
    for step in range(1, 8):
        sink.log(metrics(step), step=step)
    sink.close()
    sink.close()
    steps = [re.match(r"step (\d+)/100", l).group(1) for l in out.getvalue().splitlines()]
    assert steps == ["1", "7"]


def test_stdout_under_pytest_is_not_a_tty(capsys):
    sink = build_sinks(None, jsonl=False, wandb=False, wandb_mode="offline", project="p",
                       name="n", run_config={}, console=True, total_steps=3)
    for step in range(1, 4):
        sink.log(metrics(step), step=step)
    sink.close()
    out = capsys.readouterr().out
    assert out.count("\n") == 3 and "step 3/3" in out and "reward/mean 0.375" in out


def test_live_view_renders_figures_and_stops():
    out = io.StringIO()
    sink = ConsoleSink(total_steps=4, live=True, file=out)
    for step in range(1, 5):
        sink.log(metrics(step), step=step)
    sink.close()
    text = out.getvalue()
    assert "4/4" in text and "reward 0.5" in text and "clip 0.04" in text
