"""`rlctl reward-model train` as a user meets it: pairs that carry no preference, the
console's figures, a stop by signal, and reward-model files that cannot be used."""
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

RLCTL = str(Path(sys.executable).parent / "rlctl")
QUIET = ["logger=jsonl", "logger.console=false"]


def sorted_pairs(n: int, seed: int):
    """chosen: the prompt's digits sorted; rejected: the same sorted digits reversed."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        d = [rng.randrange(10) for _ in range(5)]
        if len(set(d)) < 2:
            continue
        s = sorted(d)
        rows.append({"prompt": " ".join(map(str, d)) + " =", "chosen": " ".join(map(str, s)),
                     "rejected": " ".join(map(str, reversed(s)))})
    return rows


def same(rows):
    return [dict(r, rejected=r["chosen"]) for r in rows]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def invoke(*args):
    from rlctl.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stdout, res.stderr)
    assert lines[0].startswith("error: ") and "Traceback" not in res.stderr
    return lines[0]


# -- pairs with chosen == rejected (issue 21.7) -------------------------------------------

def test_all_pairs_identical_is_refused_before_a_run_directory(tmp_path):
    prefs = write_jsonl(tmp_path / "same.jsonl", same(sorted_pairs(10, 0)))
    held = write_jsonl(tmp_path / "held.jsonl", sorted_pairs(4, 1))
    res = invoke("reward-model", "train", prefs, "--eval", held, *QUIET,
                 f"run.output_dir={tmp_path / 'runs'}")
    line = error_line(res)
    assert "all 10 training pairs have chosen and rejected reading as the same tokens" in line
    assert not (tmp_path / "runs").exists()


def test_some_identical_pairs_are_counted_in_one_line_and_the_summary(tmp_path):
    # 8 real pairs + 2 identical ones to train on; 3 real + 1 identical held out
    prefs = write_jsonl(tmp_path / "p.jsonl", sorted_pairs(8, 0) + same(sorted_pairs(2, 2)))
    held = write_jsonl(tmp_path / "h.jsonl", sorted_pairs(3, 1) + same(sorted_pairs(1, 3)))
    res = invoke("reward-model", "train", prefs, "--eval", held, *QUIET, "rm.steps=1",
                 f"run.output_dir={tmp_path / 'runs'}")
    assert res.exit_code == 0, res.stdout + res.stderr
    notes = [ln for ln in res.stderr.splitlines() if "chosen == rejected" in ln]
    assert len(notes) == 1, res.stderr
    assert "2 of 10 training pairs and 1 of 4 held-out pairs (--eval)" in notes[0]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_pairs_identical"] == 2 and summary["eval_pairs_identical"] == 1


# -- what the console shows, and a stop by signal (issue 21.13) ----------------------------

def test_console_shows_the_fits_loss_and_accuracy_at_each_step_and_at_the_end(tmp_path):
    prefs = write_jsonl(tmp_path / "p.jsonl", sorted_pairs(12, 0))
    held = write_jsonl(tmp_path / "h.jsonl", sorted_pairs(4, 1))
    res = invoke("reward-model", "train", prefs, "--eval", held, "logger=jsonl",
                 "logger.console=true", "rm.steps=2", "rm.batch_size=4",
                 f"run.output_dir={tmp_path / 'runs'}")
    assert res.exit_code == 0, res.stdout + res.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "step" in r}
    lines = res.stdout.splitlines()
    for step in (1, 2):     # off a TTY: one plain line per step (2 steps <= 20 lines)
        (line,) = [ln for ln in lines if ln.startswith(f"step {step}/2 ")]
        m = by_step[step]
        assert f"train/loss {m['train/loss']:.4g}" in line, line
        assert f"train/accuracy {m['train/accuracy']:.4g}" in line, line
    assert f"eval/pairwise_accuracy {by_step[2]['eval/pairwise_accuracy']:.4g}" in lines[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    (end,) = [ln for ln in lines if ln.startswith("held-out pairwise accuracy")]
    assert end == (f"held-out pairwise accuracy {summary['eval/pairwise_accuracy']:.4f} (4 pairs, "
                   f"mean margin {summary['eval/margin']:+.4f}); last training step: loss "
                   f"{by_step[2]['train/loss']:.4f}, accuracy {by_step[2]['train/accuracy']:.4f}")


@pytest.mark.parametrize("signum,code", [(15, 143), (2, 130)])
def test_a_signal_stops_the_fit_after_a_step_with_the_model_saved(tmp_path, signum, code):
    from transformers import AutoModelForSequenceClassification

    prefs = write_jsonl(tmp_path / "p.jsonl", sorted_pairs(20, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    proc = subprocess.Popen([RLCTL, "reward-model", "train", prefs, *QUIET, "rm.steps=100000",
                             "rm.eval_every=0", "rm.batch_size=2",
                             f"run.output_dir={tmp_path / 'runs'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("runs/*/metrics.jsonl")) or \
                not list(tmp_path.glob("runs/*/metrics.jsonl"))[0].read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows if "step" in r)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_at_step"] == last and 1 <= last < 100000
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == (f"interrupted by {'SIGTERM' if signum == 15 else 'SIGINT'} after step "
                         f"{last} of 100000; the model so far is saved in {run_dir / 'model'} "
                         f"(summary.json: stopped_at_step {last}; a reward-model fit does not "
                         "resume)"), err
    assert "Traceback" not in err
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert model.config.num_labels == 1


# -- reward-model and base-model files that cannot be used (issue 21.12) -------------------

RL_FAST = ["trainer.steps=1", "trainer.prompts_per_step=2", "algo.group_size=2",
           "task.num_eval=4", "trainer.eval_every=0", *QUIET]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    """(root, a one-step `reward-model train` run directory, the tiny base LM's directory)."""
    from rlctl.config.compose import compose
    from rlctl.rm.training import backbone_path

    root = tmp_path_factory.mktemp("rm_files")
    prefs = write_jsonl(root / "p.jsonl", sorted_pairs(8, 0))
    res = invoke("reward-model", "train", prefs, *QUIET, "rm.steps=1",
                 f"run.output_dir={root / 'runs'}")
    assert res.exit_code == 0, res.stdout + res.stderr
    (run_dir,) = (root / "runs").iterdir()
    return root, run_dir, Path(backbone_path(**compose([]).cfg.model))


def copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def overwrite_header(model_dir: Path) -> Path:
    """The first 8 bytes (the header's length) overwritten: an impossible header size."""
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"\xff" * 8 + data[8:])
    return f


def test_a_corrupt_safetensors_file_is_named_in_one_line_before_a_run_directory(rm_run, tmp_path):
    root, run_dir, base = rm_run
    bad_rm = copy_dir(run_dir / "model", tmp_path / "bad_rm")
    bad_file = overwrite_header(bad_rm)
    out = f"run.output_dir={tmp_path / 'runs'}"
    line = error_line(invoke("train", f"task.reward_model={bad_rm}", *RL_FAST, out))
    assert f"task.reward_model: '{bad_file}' is corrupt or truncated" in line
    line = error_line(invoke("reward-model", "eval", bad_rm, root / "p.jsonl"))
    assert f"'{bad_file}' is corrupt or truncated" in line
    bad_lm = copy_dir(base, tmp_path / "bad_lm")
    bad_file = overwrite_header(bad_lm)
    line = error_line(invoke("reward-model", "train", root / "p.jsonl", "model=hf",
                             f"model.name_or_path={bad_lm}", *QUIET, out))
    assert f"'{bad_file}' is corrupt or truncated" in line
    assert not (tmp_path / "runs").exists()


def add_pad_beyond_the_embeddings(model_dir: Path):
    """A new [PAD] token on the saved tokenizer, the embeddings left as they are."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"pad_token": "[PAD]"})
    tok.save_pretrained(model_dir)
    return len(tok), tok.pad_token_id, AutoConfig.from_pretrained(model_dir).vocab_size


def test_a_pad_token_beyond_the_embeddings_is_refused_in_one_line(rm_run, tmp_path):
    root, run_dir, base = rm_run
    out = f"run.output_dir={tmp_path / 'runs'}"
    rm_dir = copy_dir(run_dir / "model", tmp_path / "rm")
    n, pad, rows = add_pad_beyond_the_embeddings(rm_dir)
    assert pad >= rows                  # the case: an id the embedding lookup cannot take
    want = (f"the tokenizer in '{rm_dir}' has {n} tokens but the model's input embeddings "
            f"have {rows} rows (pad token '[PAD]' is id {pad})")
    assert want in error_line(invoke("train", f"task.reward_model={rm_dir}", *RL_FAST, out))
    assert want in error_line(invoke("reward-model", "eval", rm_dir, root / "p.jsonl"))
    lm = copy_dir(base, tmp_path / "lm")
    n, pad, rows = add_pad_beyond_the_embeddings(lm)
    line = error_line(invoke("reward-model", "train", root / "p.jsonl", "model=hf",
                             f"model.name_or_path={lm}", *QUIET, out))
    assert f"has {n} tokens but the model's input embeddings have {rows} rows" in line
    line = error_line(invoke("train", "model=hf", f"model.name_or_path={lm}", *RL_FAST, out))
    assert f"has {n} tokens but the model's input embeddings have {rows} rows" in line
    assert not list(tmp_path.glob("runs/*"))     # no run directory (rlctl train removes one
                                                 # whose start failed; the others make none)



def add_token(model_dir: Path, token: str, template: str = None):
    """A new special token on the saved tokenizer (and a chat template that writes it, when
    given), the embeddings left as they are: (its id, the config's embedding rows)."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens([token], special_tokens=True)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(model_dir)
    return tok.convert_tokens_to_ids(token), AutoConfig.from_pretrained(model_dir).vocab_size


def test_an_added_token_beyond_the_embeddings_that_nothing_writes_is_accepted(rm_run, tmp_path):
    """Gemma 3's text checkpoints hold <image_soft_token> at id 262144 beside 262144
    embedding rows: only its literal text yields it (not the pad/BOS/EOS rlctl inserts nor
    the chat template), so the model is usable and must not be refused. The same token
    written by the chat template would reach every batch: refused, named."""
    root, run_dir, base = rm_run
    rm_dir = copy_dir(run_dir / "model", tmp_path / "rm")
    lm = copy_dir(base, tmp_path / "lm")
    for d in (rm_dir, lm):
        tid, rows = add_token(d, "<image_soft_token>")
        assert tid == rows              # the case: one id beyond the embeddings, unused
    for args in ([f"task.reward_model={rm_dir}"], ["model=hf", f"model.name_or_path={lm}"]):
        res = invoke("train", *args, *RL_FAST, f"run.output_dir={tmp_path / 'runs'}")
        assert res.exit_code == 0, res.stdout + res.stderr
    written = copy_dir(base, tmp_path / "lm_template")
    tid, rows = add_token(written, "<turn>", "{% for m in messages %}<turn>{{ m['content'] }}"
                                             "{% endfor %}")
    assert tid == rows
    line = error_line(invoke("train", "model=hf", f"model.name_or_path={written}", *RL_FAST,
                             f"run.output_dir={tmp_path / 'runs2'}"))
    assert f"have {rows} rows (token '<turn>' is id {tid})" in line

def test_a_lora_adapter_as_the_base_model_says_what_to_pass(rm_run, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    root, _, base = rm_run
    run = tmp_path / "lora_run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")      # a run directory holds config.yaml
    lm = AutoModelForCausalLM.from_pretrained(base)
    adapter = peft.get_peft_model(lm, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(run / "model")
    out = f"run.output_dir={tmp_path / 'runs'}"
    want = (f"'{run / 'model'}' is a LoRA adapter (adapter_config.json), not a whole model; "
            f"pass its base model ({base}) as model.name_or_path")
    line = error_line(invoke("train", "model=hf", f"model.name_or_path={run / 'model'}",
                             *RL_FAST, out))
    assert want in line and f"give '{run}' as the TARGET of rlctl eval or rlctl rollout" in line
    line = error_line(invoke("reward-model", "train", root / "p.jsonl", "model=hf",
                             f"model.name_or_path={run / 'model'}", *QUIET, out))
    assert want in line
    assert not (tmp_path / "runs").exists()


def test_a_reward_model_run_directory_is_taken_for_its_model(rm_run, tmp_path):
    _, run_dir, _ = rm_run
    res = invoke("train", f"task.reward_model={run_dir}", *RL_FAST,
                 f"run.output_dir={tmp_path / 'runs'}")
    assert res.exit_code == 0, res.stdout + res.stderr
    (rl_run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(ln) for ln in (rl_run / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/reward_model" in r for r in rows)
