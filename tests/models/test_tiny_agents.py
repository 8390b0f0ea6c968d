"""The tiny model's agent warm-ups (rlctl/models/tiny_agents.py): the default model's
vocabulary and cache key untouched, the transcript layout and its loss labels, the
scripted episodes, and at step 0 the intended format of the shipped agent models' greedy
episodes, played by the real episode loop (rlctl.rollout.episodes)."""
import os

import pytest
from omegaconf import OmegaConf

from rlctl.envs.vocab import TINY_AGENT_WORDS
from rlctl.models import load_model_and_tokenizer
from rlctl.models.agent_scripts import MODEL, MODEL_CUT, OBS
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.models.tiny import build_params, build_tiny, build_tokenizer, cache_key
from rlctl.models.tiny_agents import (AGENT_WARMUPS, agent_params, build_tiny_model,
                                      transcript_rows, warmup_transcripts)
from rlctl.rollout.episodes import EpisodePlayer, EpisodeSettings
from rlctl.tasks import build_task
from rlctl.types import MODEL as SPAN_MODEL

# The default tiny vocabulary, written out: ids 0..18
DEFAULT_WORDS = ["<pad>", "<bos>", "<eos>", "<unk>"] + [str(d) for d in range(10)] + \
    ["=", "+", "-", "*", ":"]
SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, warmup_steps=3, warmup_lr=1e-3)
RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")


def test_default_vocabulary_unchanged_and_agent_words_appended():
    assert build_tokenizer().get_vocab() == {w: i for i, w in enumerate(DEFAULT_WORDS)}
    agent = build_tokenizer(TINY_AGENT_WORDS).get_vocab()
    assert agent == {w: i for i, w in enumerate(DEFAULT_WORDS + list(TINY_AGENT_WORDS))}


def test_other_tasks_build_the_default_model_and_keys(tmp_path):
    """Sorting, jsonl (and any non-agent task) get build_tiny's model: its cache directory
    (made here empty, so a hit builds nothing); the sorting key has no agent settings."""
    path = tmp_path / cache_key(build_params(**SMALL))
    path.mkdir()
    assert build_tiny(**SMALL, cache_dir=tmp_path) == path
    for task in ("sorting", "jsonl", None):
        assert build_tiny_model(**SMALL, warmup_task=task, cache_dir=tmp_path) == path
    assert sorted(build_params(**SMALL)) == sorted(
        ["code_version", "hidden_size", "num_layers", "num_heads", "warmup_steps", "warmup_lr",
         "warmup_batch_size", "warmup_num_digits", "warmup_task_seed", "warmup_sorted_frac",
         "seed", "torch", "transformers"])


def test_agent_cache_key_covers_params_and_transcripts(monkeypatch):
    for name in ("calculator", "guess_number"):     # fewer scripted episodes: a cheaper digest
        monkeypatch.setitem(AGENT_WARMUPS, name, dict(AGENT_WARMUPS[name], episodes=50))
    args = dict(hidden_size=32, num_layers=1, num_heads=2, warmup_steps=3, warmup_lr=1e-3, seed=0)
    base = agent_params("calculator", **args)
    assert base["warmup_task"] == "calculator" and base["agent_words"] == list(TINY_AGENT_WORDS)
    keys = {cache_key(base), cache_key(build_params(**SMALL)),
            cache_key(agent_params("guess_number", **args)),
            cache_key(agent_params("calculator", **dict(args, seed=1))),
            cache_key(agent_params("calculator", **dict(args, warmup_steps=4)))}
    monkeypatch.setitem(AGENT_WARMUPS, "calculator", dict(AGENT_WARMUPS["calculator"],
                                                          episodes=50, call_frac=0.9))
    changed = agent_params("calculator", **args)
    assert changed["warmup_transcripts"] != base["warmup_transcripts"]
    keys.add(cache_key(changed))
    assert len(keys) == 6


def test_transcript_rows_label_model_turns_only():
    tok = build_tokenizer(TINY_AGENT_WORDS)
    v = {w: i for i, w in enumerate(DEFAULT_WORDS + list(TINY_AGENT_WORDS))}
    prompt = [v["<bos>"], v["1"], v["2"], v["*"], v["3"], v["="]]
    call = [v["<call>"], v["calc"], v["1"], v["2"], v["*"], v["3"], v["</call>"]]
    result = [v["<result>"], v["3"], v["6"], v["</result>"]]
    answer = [v["3"], v["6"], v["<eos>"]]
    tr = [("prompt", "1 2 * 3 ="), (MODEL, "<call> calc 1 2 * 3 </call>"),
          (OBS, "<result> 3 6 </result>"), (MODEL, "3 6")]
    cut = [("prompt", "1 2 * 3 ="), (MODEL_CUT, "<call> calc 1 2 * 3 </call>"),
           (OBS, "<result> 3 6 </result>")]
    ids, mask, labels = transcript_rows(tok, [tr, cut])
    row0 = prompt + call + [v["<eos>"]] + result + answer
    row1 = prompt + call + result                        # a cut turn: no <eos>
    assert ids[0].tolist() == row0
    assert ids[1].tolist() == row1 + [v["<pad>"]] * (len(row0) - len(row1))
    assert mask[1].tolist() == [1] * len(row1) + [0] * (len(row0) - len(row1))
    hidden = [-100]
    assert labels[0].tolist() == hidden * 6 + call + [v["<eos>"]] + hidden * 4 + answer
    assert labels[1].tolist() == hidden * 6 + call + hidden * (len(row0) - 6 - len(call))


def test_scripted_episodes_follow_the_environments():
    tok = build_tokenizer(TINY_AGENT_WORDS)
    calc = warmup_transcripts("calculator", AGENT_WARMUPS["calculator"], 0, tok)
    calls = [tr for tr in calc if tr[1][1].startswith("<call>")]
    p, n = AGENT_WARMUPS["calculator"]["call_frac"], len(calc)
    assert abs(len(calls) / n - p) < 4 * (p * (1 - p) / n) ** 0.5     # binomial, 4 sd
    assert all(tr[2][1].split()[1:-1] == tr[3][1].split() for tr in calls)  # result copied
    assert all(OBS not in [r for r, _ in tr] for tr in calc if tr not in calls)   # direct: done
    held = {ex.prompt for ex in build_task("calculator").eval_examples()}
    assert not held & {tr[0][1] for tr in calc}                     # training rows only
    for tr in warmup_transcripts("guess_number", AGENT_WARMUPS["guess_number"], 0, tok)[:300]:
        lo, hi = 1, 16
        for (role, text), answer in zip(tr[1::2], tr[2::2] + [(OBS, "")]):
            guess = int("".join(text.split()))
            assert role == MODEL and lo <= guess <= hi             # narrow_frac 1: consistent
            lo, hi = (guess + 1, hi) if answer[1] == "higher" else (lo, guess - 1) \
                if answer[1] == "lower" else (lo, hi)


def _recipe(name):
    return OmegaConf.load(os.path.join(RECIPES, f"{name}.yaml"))


@pytest.fixture(scope="module")
def agent_episodes(build_once, tiny_cfg):
    """Greedy episodes at step 0 of each shipped agent model, with its recipe's budgets.
    The models are built once per run, into $RLCTL_CACHE when it is set (.ci/run sets it:
    their keys cover every input, so later runs reuse them), else the run's temp dir."""
    played = {}
    for task_name, recipe in (("calculator", "calculator-tool"), ("guess_number", "guess-number"),
                              ("running_sum", "running-sum")):
        cache = build_once(f"rlctl_cache_{task_name}", lambda d, t=task_name: build_tiny_model(
            warmup_task=t, cache_dir=os.environ.get("RLCTL_CACHE") or d, **tiny_cfg).parent)
        model, tok = load_model_and_tokenizer("tiny", warmup_task=task_name, cache_dir=cache,
                                              **tiny_cfg)
        ro = _recipe(recipe).rollout
        settings = EpisodeSettings(group_size=1, max_new_tokens=ro.max_new_tokens,
                                   temperature=1.0, max_turns=ro.episode.max_turns,
                                   max_tokens=ro.episode.max_tokens)
        task = build_task(task_name)
        player = EpisodePlayer(tok, task, settings, resolve_stop_ids(model, tok))
        rows = (task.eval_examples() + task.train_examples())[:128]   # guess_number: all 16
        played[task_name] = player.play(model, rows, 0, greedy=True).episodes
    return played


def _turns(ep):
    return [s.text for s in ep.spans if s.role == SPAN_MODEL]


def test_calculator_step0_calls_the_tool_sometimes(agent_episodes):
    eps = agent_episodes["calculator"]
    called = [e for e in eps if e.tool_calls]
    assert 0.15 <= len(called) / len(eps) <= 0.7              # a fair share, not all
    assert all(e.tool_errors == 0 for e in called)            # every call parses and runs
    direct = [e for e in eps if not e.tool_calls]
    assert direct and all(e.turns == 1 for e in direct)       # answered directly ...
    assert sum(bool(e.success) for e in direct) <= 0.1 * len(direct)   # ... and wrongly
    assert all(t.split()[0].isdigit() for e in direct for t in _turns(e))


def test_guess_number_step0_guesses_valid_numbers_not_binary_search(agent_episodes):
    eps = agent_episodes["guess_number"]
    guesses = [t for e in eps for t in _turns(e)]
    assert all(t.split() and all(w.isdigit() for w in t.split()) for t in guesses)
    assert all(1 <= int("".join(t.split())) <= 16 for t in guesses)
    success = sum(bool(e.success) for e in eps) / len(eps)
    assert success < 0.95 or sum(e.turns for e in eps) / len(eps) > 4.5   # not the optimum yet


def test_running_sum_step0_answers_numbers_partly_right(agent_episodes):
    eps = agent_episodes["running_sum"]
    assert all(e.turns == 3 and e.status == "done" for e in eps)
    assert all(all(w.isdigit() for w in t.split()) and t for e in eps for t in _turns(e))
    right = sum(sum(e.turn_rewards) for e in eps) / (3 * len(eps))
    assert 0.05 <= right <= 0.8
