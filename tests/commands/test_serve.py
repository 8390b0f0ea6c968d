"""`rlctl serve`: a run directory served over HTTP (its model/), checked through the server
engine against the torch engine on the same saved model; `rlctl serve RUN --port 0` in a real
process, talked to by the `openai` client (models, text completions, chat completions through
the tokenizer's chat template); bind failures and bad arguments are one line."""
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from rlctl.commands.serve_cmd import serving_app
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.rollout.engines.protocol import Sampling, TorchEngine
from rlctl.rollout.engines.server import ServerEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from serving import ServeThread  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
START_S = 120          # the served process imports torch and loads the model: bounded
# renders [user: "3 1 2"] as the sorting task's prompt "3 1 2 :" (the tiny vocabulary)
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}:{% endif %}"


def greedy(model_dir: Path, text: str, max_new: int):
    """The torch engine's greedy completion of ``text`` on the saved model, and its text."""
    model, tok = load_model_and_tokenizer("hf", name_or_path=str(model_dir))
    (c,) = TorchEngine(model.eval(), tok.pad_token_id).generate(
        [tok(text)["input_ids"]], Sampling(max_new, 0.0, 0, (tok.eos_token_id,)))
    return c, tok.decode(c.token_ids, skip_special_tokens=True)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def in_process(run_a):
    """Run A's app (no chat template) on a free 127.0.0.1 port in this process."""
    server = ServeThread(serving_app(str(run_a), [])[0])
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def chat_run(run_a, tmp_path_factory):
    """A copy of run A whose tokenizer has a chat template."""
    run = tmp_path_factory.mktemp("serve") / run_a.name
    shutil.copytree(run_a, run, ignore=shutil.ignore_patterns("checkpoints"))
    tok = AutoTokenizer.from_pretrained(run / "model")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(run / "model")
    return run


@pytest.fixture(scope="module")
def served(chat_run, tmp_path_factory):
    """`rlctl serve RUN --port 0` in a subprocess: (its first stdout line, the URL in it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(tmp_path_factory.mktemp("serve_log") / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli", "serve", str(chat_run),
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=env)
        lines: "queue.Queue" = queue.Queue()      # stdout's lines, then "" at its end
        threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put("")],
                         daemon=True).start()
        try:
            try:
                line = lines.get(timeout=START_S)
            except queue.Empty:
                line = ""
            found = re.search(r" on (http://\S+) ", line)
            if not found:
                err.seek(0)
                pytest.fail(f"rlctl serve printed no URL ({line!r}) in {START_S} s: {err.read()}")
            yield line, found.group(1)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        err.seek(0)
        assert "Traceback" not in err.read()


def test_port_0_prints_the_bound_port_and_models_lists_the_run(served, chat_run):
    line, url = served
    assert line.startswith(f"serving {chat_run / 'model'} as model '{chat_run.name}' on ")
    port = int(re.fullmatch(r"http://127\.0\.0\.1:(\d+)", url).group(1))
    assert port > 0
    assert [m.id for m in client(url).models.list()] == [chat_run.name]
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        assert resp.status == 200


def test_openai_client_completes_text_and_chat_as_the_torch_engine(served, chat_run):
    """A text prompt is encoded with the run's tokenizer; chat messages through its chat
    template give the same prompt ids, so the same greedy tokens and log-probs."""
    want, text = greedy(chat_run / "model", "3 1 2 :", 4)
    ids, logprobs = want.token_ids, want.logprobs
    c = client(served[1])
    (got,) = c.completions.create(model=chat_run.name, prompt="3 1 2 :", max_tokens=4,
                                  temperature=0, logprobs=1).choices
    assert (got.token_ids, got.logprobs.token_logprobs, got.text) == (ids, logprobs, text)
    assert got.finish_reason == want.finish_reason
    many = c.completions.create(model=chat_run.name, prompt=["3 1 2 :", "9 7 :"], n=2,
                                max_tokens=4, temperature=0).choices
    assert [x.index for x in many] == [0, 1, 2, 3] and many[0].token_ids == many[1].token_ids == ids
    reply = c.chat.completions.create(model=chat_run.name, max_tokens=4, temperature=0,
                                      logprobs=True, messages=[{"role": "user", "content": "3 1 2"}])
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == text and choice.token_ids == ids
    assert [t.logprob for t in choice.logprobs.content] == logprobs
    assert choice.finish_reason == want.finish_reason


def test_bad_requests_are_400s_in_openais_shape(served, in_process, chat_run):
    c = client(served[1])
    with pytest.raises(openai.BadRequestError, match="unknown field 'stop'"):
        c.completions.create(model=chat_run.name, prompt="3 :", max_tokens=2, stop=["1"])
    with pytest.raises(openai.BadRequestError, match="needs a tokenizer with a chat template; "
                                                     "this model's tokenizer has none"):
        client(in_process).chat.completions.create(
            model="a", messages=[{"role": "user", "content": "3 1"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        c.chat.completions.create(model=chat_run.name, messages=[], max_tokens=2)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{served[1]}/v1/embeddings", timeout=10)
    assert info.value.code == 404
    assert info.value.read() == (b'{"error":{"message":"Not Found: GET /v1/embeddings",'
                                 b'"type":"NotFoundError","code":404}}')


def test_a_run_dir_serves_its_saved_model(run_a, in_process):
    model, tok = load_model_and_tokenizer("hf", name_or_path=str(run_a / "model"))
    prompts = [tok(t)["input_ids"] for t in ("3 1 2 :", "9 7 :", "9 7 :")]
    greedy_ = Sampling(6, 0.0, 0, (tok.eos_token_id,))
    got = ServerEngine([in_process]).generate(prompts, greedy_)
    want = TorchEngine(model.eval(), tok.pad_token_id).generate(prompts, greedy_)
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in want]


@pytest.mark.parametrize("host, reason", [("127.0.0.1", "Address already in use"),
                                          ("203.0.113.7", "Cannot assign requested address")])
def test_a_port_that_cannot_be_bound_is_one_line(cli, run_a, host, reason):
    if host != "127.0.0.1" and Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() != "0":
        pytest.skip("this machine binds any address (net.ipv4.ip_nonlocal_bind): it would serve")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1] if host == "127.0.0.1" else 0
        result = cli("serve", run_a, "--host", host, "--port", port)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == (f"error: cannot listen on {host}:{port}: {reason} (choose another "
                                     "--port, or --port 0 for a free one)")


@pytest.mark.parametrize("args, message", [
    (["serve", "/no/such/dir"], "no such file or directory: '/no/such/dir'"),
    (["serve", "--port", "x"], "--port expects an integer, got 'x'"),
    (["serve", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
])
def test_bad_arguments_are_one_line(cli, args, message):
    result = cli(*args)
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
