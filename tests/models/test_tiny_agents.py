"""The tiny model's agent warm-ups (rlctl/demo/tiny_agents.py): the default model's
vocabulary and cache key untouched, the transcript layout and its loss labels, the
scripted episodes, and small agent models (the same build, a few warm-up steps) routed,
cached and answering in the format, played by the real episode loop
(rlctl.rollout.episodes.loop). The shipped models are not built here (minutes):
bench/agent_warmups.py prints their step-0 numbers."""
import json
import os

import pytest
from omegaconf import OmegaConf

from rlctl.envs.calc import TINY_AGENT_WORDS
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.demo import tiny_agents
from rlctl.models.loading import build_tiny_model
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.demo.tiny import AGENT_TASKS, build_params, build_tiny, build_tokenizer, cache_key
from rlctl.demo.tiny_agents import (AGENT_WARMUPS, MODEL, MODEL_CUT, OBS, agent_params,
                                      transcript_rows, warmup_transcripts)
from rlctl.config.schema import EpisodeConfig, RolloutConfig
from rlctl.rollout.episodes.loop import EpisodePlayer
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


def test_the_loader_routes_exactly_the_agent_warmups_tasks():
    assert tuple(AGENT_WARMUPS) == AGENT_TASKS


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


# ---- small warm-ups, played by the real episode loop ------------------------------------
# The same build with smaller parameters (seconds, not the shipped models' minutes): enough
# for the turns' format. The shipped models' step-0 numbers (tool-call share, success,
# turns): bench/agent_warmups.py and the recipes' headers, not this suite.
SMALL_AGENT = dict(hidden_size=32, num_layers=1, num_heads=2, warmup_steps=15, warmup_lr=1e-3)
AGENT_RECIPES = {"calculator": "calculator-tool", "guess_number": "guess-number",
                 "running_sum": "running-sum"}


def _recipe_settings(name):
    ro = OmegaConf.load(os.path.join(RECIPES, f"{name}.yaml")).rollout
    return RolloutConfig(max_new_tokens=ro.max_new_tokens, temperature=1.0, episode=EpisodeConfig(
        max_turns=ro.episode.max_turns, max_tokens=ro.episode.max_tokens))


def _small(build_once, task_name, **changes):
    """Cache directory of a small agent model, built once per run (into $RLCTL_CACHE when
    it is set: the keys cover every input, so later runs reuse it)."""
    args = dict(SMALL_AGENT, **changes)
    tag = "-".join(f"{k}{v}" for k, v in sorted(changes.items()))
    return build_once(f"rlctl_cache_agent_{task_name}{tag}", lambda d: build_tiny_model(
        warmup_task=task_name, cache_dir=os.environ.get("RLCTL_CACHE") or d, **args).parent), args


def _greedy(cache, args, task_name, rows=32):
    model, tok = load_model_and_tokenizer("tiny", warmup_task=task_name, cache_dir=cache, **args)
    task = build_task(task_name)
    player = EpisodePlayer(tok, task, _recipe_settings(AGENT_RECIPES[task_name]), 1,
                           resolve_stop_ids(model, tok))
    return player.play(model, task.eval_examples()[:rows], 0, greedy=True), tok


@pytest.fixture(scope="module")
def small_agents(build_once):
    """task -> (cache directory, greedy batch on its first eval rows, tokenizer)."""
    out = {}
    for name in AGENT_RECIPES:
        cache, args = _small(build_once, name)
        out[name] = (cache, *_greedy(cache, args, name))
    return out


def _turns(ep):
    return [s.text for s in ep.spans if s.role == SPAN_MODEL]


def _number_share(batch):
    """Share of model turns that are digit words (the warm-ups' answer format)."""
    turns = [t for e in batch.episodes.records for t in _turns(e)]
    return sum(bool(t.split()) and all(w.isdigit() for w in t.split()) for t in turns) / len(turns)


def test_agent_models_are_routed_by_task_and_cached(small_agents, monkeypatch):
    """Each task's model is its own agent build (metadata, the agent vocabulary), and
    asking again builds nothing (the build function is made to fail)."""
    def no_build(directory, params):
        raise AssertionError(f"rebuilt {params['warmup_task']}")
    monkeypatch.setattr(tiny_agents, "_build_agent_into", no_build)
    vocab = {w: i for i, w in enumerate(DEFAULT_WORDS + list(TINY_AGENT_WORDS))}
    dirs = set()
    for name, (cache, _, tok) in small_agents.items():
        path = build_tiny_model(warmup_task=name, cache_dir=cache, **SMALL_AGENT)
        assert path.parent == cache and path.is_dir()
        meta = json.loads((path / "rlctl_tiny.json").read_text())
        assert meta["warmup_task"] == name and meta["agent_words"] == list(TINY_AGENT_WORDS)
        assert (meta["hidden_size"], meta["num_layers"], meta["warmup_steps"]) == (32, 1, 15)
        assert tok.get_vocab() == vocab
        dirs.add(path.name)
    assert len(dirs) == 3


def test_small_warmups_answer_in_numbers_through_the_episode_loop(small_agents):
    """After 30-60 warm-up steps the greedy turns are numbers (digit words):
    the format, not the skill; observations are tokenized without <unk> (the agent
    vocabulary has every word the environments write)."""
    for name, (_, batch, tok) in small_agents.items():
        assert _number_share(batch) >= 0.8, name     # measured 1.0, 1.0, 0.96; untrained 0.0
        ids = batch.completion_ids[batch.completion_ids != tok.pad_token_id]
        assert tok.unk_token_id not in ids.tolist()
        assert all(e.turns >= 1 and e.status in ("done", "turn_limit") for e in batch.episodes.records)


def test_without_the_warmup_turns_are_not_numbers(build_once):
    """The control of the test above: the same model with no warm-up steps."""
    cache, args = _small(build_once, "guess_number", warmup_steps=0)
    batch, _ = _greedy(cache, args, "guess_number")
    assert _number_share(batch) <= 0.2              # measured 0.0 (': : :', 'error error ...')
