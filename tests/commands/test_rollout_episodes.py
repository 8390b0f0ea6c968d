"""`rlctl rollout`, `rlctl inspect` and `--resume` of a task played as episodes
(guess_number on the tiny model, in this process): every turn of a dumped episode with
its tokens, mask, log-probs and reward, checked against the environment's rule (written
here from its docs) and an unpadded forward; then the round trip of issue 23: the dump
audited by `rlctl inspect FILE`, the run's sample tables shown turn by turn by
`rlctl inspect RUN --samples`, and the run resumed from a mid-run checkpoint."""
import json
import shutil

import pytest
import torch

from rlctl.config.compose import compose
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.train.build import task_from_config

EPISODE = ["task=guess_number", "task.max_number=4", "task.num_eval=1", "model.warmup_task=sorting", "rollout.max_new_tokens=1",
           "rollout.episode.max_turns=4", "rollout.episode.max_tokens=14", "rollout.temperature=1.0"]
TRAIN = ["trainer.steps=2", "trainer.checkpoint_every=1", "trainer.eval_every=0",
         "trainer.prompts_per_step=2", "algo.group_size=2", "logger=jsonl", "logger.console=false",
         "logger.samples.every=1", "logger.samples.n=4"]
PROMPTS, SAMPLES = 3, 3


@pytest.fixture(scope="module")
def episode_run(tmp_path_factory, rlctl_app):
    run = tmp_path_factory.mktemp("ep_run") / "run"
    done = rlctl_app("train", *EPISODE, *TRAIN, f"run.dir={run}")
    assert done.returncode == 0, done.stdout + done.stderr
    return run


@pytest.fixture(scope="module")
def dump(episode_run, rlctl_app):
    out = episode_run.parent / "episodes.jsonl"
    done = rlctl_app("rollout", episode_run, "--out", out, "--prompts", PROMPTS,
                     "--samples", SAMPLES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote {PROMPTS * SAMPLES} episodes" in done.stdout
    return [json.loads(line) for line in out.read_text().splitlines()], out


def _number(text):
    """guess_number's reading of a turn (its docs): digit words spell a number."""
    words = text.split()
    neg = words[:1] == ["-"]
    digits = "".join(words[1:] if neg else words)
    return (-1 if neg else 1) * int(digits) if digits.isdigit() else None


def test_every_turn_is_dumped_with_its_tokens_mask_logprobs_and_reward(dump, episode_run):
    rows, _ = dump
    assert [(r["group"], r["sample"]) for r in rows] == [(g, s) for g in range(PROMPTS) for s in range(SAMPLES)]
    secrets = [ex.fields["secret"] for ex in task_from_config(compose(EPISODE).cfg).task.train_examples()]
    model, tok = load_model_and_tokenizer("hf", name_or_path=str(episode_run / "model"))
    model.eval()
    for r in rows:
        turns, ids = r["turns"], r["token_ids"]
        assert [i for t in turns for i in t["token_ids"]] == ids
        assert r["mask"] == [int(t["role"] == "model") for t in turns for _ in t["token_ids"]]
        assert r["length"] == sum(r["mask"]) and r["transcript_length"] == len(ids)
        assert [t["start"] for t in turns] == [sum(len(u["token_ids"]) for u in turns[:k]) for k in range(len(turns))]
        model_turns = [t for t in turns if t["role"] == "model"]
        assert r["num_turns"] == len(model_turns) <= 4 and turns[0]["role"] == "model"
        assert all(len(t["token_ids"]) == 1 for t in model_turns)
        # the environment's answers, from its rule: higher / lower / error, done when right
        secret = secrets[r["prompt_index"]]
        for k, t in enumerate(model_turns):
            guess, after = _number(t["text"]), turns[turns.index(t) + 1:turns.index(t) + 2]
            right = guess == secret
            assert t["reward"] == float(right)
            if right:
                assert not after and r["status"] == "done" and r["success"] is True
            elif k + 1 < len(model_turns):
                expect = "error" if guess is None else ("higher" if guess < secret else "lower")
                assert after[0]["role"] == "observation" and after[0]["text"] == expect
        assert r["turn_rewards"] == [t["reward"] for t in model_turns]
        assert r["reward"] == pytest.approx(sum(r["turn_rewards"]))      # turn_reward=sum
        assert r["truncated"] == (r["status"] != "done") and r["correct"] == (r["reward"] > 0)
        assert r["tool_task"] is False and r["tool_calls"] == 0
        # behaviour log-probs on model tokens = an unpadded forward of prompt + transcript
        prompt = tok([r["prompt"]], return_tensors="pt")["input_ids"]            # [1, P]
        full = torch.cat([prompt, torch.tensor([ids])], dim=1)                   # [1, P+T]
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, prompt.shape[1] - 1:-1]     # [T, V]
        expected = torch.log_softmax(logits.float() / 1.0, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        expected = (expected * torch.tensor(r["mask"])).tolist()                 # 0 on observations
        assert r["logprobs"] == pytest.approx(expected, abs=1e-4)
        for t in model_turns:
            assert t["logprobs"] == r["logprobs"][t["start"]:t["end"]]


def test_the_dump_the_samples_and_a_resume_round_trip(dump, episode_run, rlctl_app, tmp_path):
    rows, path = dump
    # the dump audited: the transcript checks hold, the episode signs count by hand
    done = rlctl_app("inspect", path, "--json", tmp_path / "audit.json")
    assert done.returncode == 0, done.stdout + done.stderr
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["alignment_ok"] and audit["checks"]["turns_cover_tokens"]["applicable"] == len(rows)
    assert "eos_xor_truncated" not in audit["checks"]
    signs = {s["sign"]: s for s in audit["hacking_signs"]}
    at_limit = [i + 1 for i, r in enumerate(rows) if r["status"] == "turn_limit"]
    assert signs["episodes_at_turn_limit"]["count"] == len(at_limit)
    if at_limit:
        assert signs["episodes_at_turn_limit"]["example"]["line"] == at_limit[0]
    assert signs["tool_never_called"]["value"] is None          # guess_number offers no tool
    assert audit["episodes"]["episodes"] == len(rows)
    # the run's sample tables: each row turn by turn, shown as such
    done = rlctl_app("inspect", episode_run, "--samples", "--json", tmp_path / "samples.json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "samples.json").read_text())
    train = report["tables"]["train"]
    assert train and all(r["finish_reason"] == r["status"] for r in train)
    for r in train:
        roles = [t["role"] for t in r["turns"]]
        assert roles[0] == "model" and roles.count("model") == r["num_turns"]
        assert all(a != b for a, b in zip(roles, roles[1:]))     # model turns and observations alternate
    assert {s["sign"] for s in report["audit"]["hacking_signs"]} >= {"episodes_at_turn_limit"}
    shown = rlctl_app("inspect", episode_run, "--samples")
    first = train[0]["turns"]
    assert f"model 1:    {first[0]['text']!r}" in shown.stdout
    if len(first) > 1:
        assert f"observation: {first[1]['text']!r}" in shown.stdout
    # resumed from the step-1 checkpoint, step 2 is redone exactly
    cut = tmp_path / "cut"
    shutil.copytree(episode_run, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000002")
    (cut / "summary.json").unlink()
    done = rlctl_app("train", "--resume", cut)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (cut / "samples.jsonl").read_text() == (episode_run / "samples.jsonl").read_text()
