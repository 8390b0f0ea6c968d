"""`rlctl serve`: a run directory served over HTTP (its model/), checked through the server
engine against the torch engine on the same saved model; bad arguments are one line."""
import sys
from pathlib import Path

import pytest

from rlctl.commands.serve_cmd import serving_app
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.rollout.engines.protocol import Sampling, TorchEngine
from rlctl.rollout.engines.server import ServerEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from serving import ServeThread  # noqa: E402


def test_a_run_dir_serves_its_saved_model(run_a):
    app, what = serving_app(str(run_a), [])
    assert what == str(run_a / "model")
    model, tok = load_model_and_tokenizer("hf", name_or_path=str(run_a / "model"))
    prompts = [tok(t)["input_ids"] for t in ("3 1 2 :", "9 7 :", "9 7 :")]
    greedy = Sampling(6, 0.0, 0, (tok.eos_token_id,))
    server = ServeThread(app)
    try:
        got = ServerEngine([server.url]).generate(prompts, greedy)
    finally:
        server.stop()
    want = TorchEngine(model.eval(), tok.pad_token_id).generate(prompts, greedy)
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in want]


@pytest.mark.parametrize("args, message", [
    (["serve", "/no/such/dir"], "no such file or directory: '/no/such/dir'"),
    (["serve", "--port", "x"], "--port expects an integer, got 'x'"),
    (["serve", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
])
def test_bad_arguments_are_one_line(cli, args, message):
    result = cli(*args)
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
