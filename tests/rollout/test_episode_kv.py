"""The episode KV cache carried across turns (rlctl/rollout/episodes/kv.py) against the
recompute path, on float64 models: a 2-layer Llama (rlctl's tiny model), and Qwen2- and
GPT-2-shaped ones (tests/models/arch_zoo.py configurations on the tiny tokenizer); models
whose cache would see the gaps fall back to recomputing.

The environment makes gaps on purpose: observations of 1 to 9 tokens that differ between
the episodes (so each turn's new tokens have different lengths), stop strings that cut a
turn before the tokens sampled after it, EOS stops at different steps in different rows
(the sampler pads the finished rows), and steps without an observation (the model writes
again: its turn's last token is all the new context). Both paths draw from the same seed.

Tolerance of the behaviour log-probs: the two paths compute each logit from the same
tokens and positions, with masked keys contributing exactly 0; they differ in the layout
of the sums (one prefill of the whole context vs cached keys, a compacted cache and a
chunk of new tokens), so in float64 (unit 1.1e-16) each of the few thousand accumulated
terms of size O(10) per logit may round differently: 1e-12 bounds that. Transformers'
RMSNorm runs in float32 (unit 6e-8) and would turn a float64 difference that straddles a
float32 rounding boundary into ~1e-7, which happens with probability ~1e-9 per element:
1e-10 leaves room for a few such flips while a wrong cache (a gap or pad attended, a
position off by one, a row of another episode) moves log-probs by 1e-4 or more (measured:
6e-4 to 3). The tokens must be identical: they are drawn from the float32 scores of these
logits.
"""
import itertools
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from arch_zoo import build_config  # noqa: E402
from episode_runs import player_settings  # noqa: E402

from rlctl.envs.environment import EnvTask# noqa: E402
from rlctl.models.forward import learner_forward# noqa: E402
from rlctl.models import kv_share  # noqa: E402
from rlctl.demo.tiny import build_model, build_tokenizer# noqa: E402
from rlctl.rollout.episodes.kv import CachedTurns, Recompute, gaps_unsupported, turn_sampler# noqa: E402
from rlctl.rollout.episodes.loop import EpisodePlayer  # noqa: E402
from rlctl.types import Example, Step  # noqa: E402

TOL = 1e-10
ROWS = [Example("1 2 +"), Example("3 *"), Example("4 5 6 7 -")]
OBSERVATIONS = ["1", "+ 2 3", None, "4 5 6 7 8 9 = 1 2", "- 3", None, "6 7 8 9 ="]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _hf(name, tok, seed=0):
    from transformers import AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(build_config(name, tok))
        with torch.no_grad():          # no zero biases or pad rows to hide a leak
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return model.double().eval()


@pytest.fixture(scope="module")
def models(tok):
    return {"llama": build_model(tok, hidden_size=32, num_layers=2, num_heads=4, seed=0).double().eval(),
            "qwen2": _hf("qwen2", tok), "gpt2": _hf("gpt2", tok)}


class Varied:
    """Episode e's step k answers OBSERVATIONS[(e + k) % 7] (None: no observation), with a
    stop string on every third step; done after 3 + e % 3 steps (the cache loses rows)."""
    counter = itertools.count()

    def __init__(self, offset):
        self.offset = offset

    def reset(self, example, seed):
        self.k = 0
        return example.prompt

    def step(self, turn):
        self.k += 1
        info = {"stop": "+"} if (self.offset + self.k) % 3 == 0 else {}
        return Step(observation=OBSERVATIONS[(self.offset + self.k) % len(OBSERVATIONS)],
                    reward=float(len(turn.ids)), done=self.k >= 3 + self.offset % 3, info=info)


def _play(model, tok, kv_reuse, seed=3, **kw):
    s = player_settings(**{"group_size": 2, "max_new_tokens": 5, "temperature": 1.0,
                           "max_turns": 6, "max_tokens": 60, "max_obs_tokens": 16,
                           "kv_reuse": kv_reuse, **kw})
    offsets = itertools.count()
    task = EnvTask("varied", lambda: Varied(next(offsets)), ROWS, ROWS)
    torch.manual_seed(seed)
    return EpisodePlayer(tok, task, *s, (tok.eos_token_id,)).play(model, ROWS, seed=seed)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_cached_turns_equal_recomputed_turns(models, tok, name):
    model = models[name]
    assert gaps_unsupported(model) is None
    assert isinstance(turn_sampler(model, tok.pad_token_id), CachedTurns)
    cached, recomputed = _play(model, tok, True), _play(model, tok, False)
    # the episodes made gaps: turns of different lengths side by side, early EOS stops
    turn_lens = {tuple(s.end - s.start for s in e.spans if s.role == "model") for e in cached.episodes.records}
    assert len(turn_lens) > 1 and any(min(t) < 5 for t in turn_lens)
    assert sum(e.turns for e in cached.episodes.records) >= 18 and len({e.turns for e in cached.episodes.records}) > 1
    assert torch.equal(cached.input_ids, recomputed.input_ids)
    assert torch.equal(cached.attention_mask, recomputed.attention_mask)
    assert torch.equal(cached.mask, recomputed.mask)
    assert [[(s.role, s.start, s.end) for s in e.spans] for e in cached.episodes.records] == \
        [[(s.role, s.start, s.end) for s in e.spans] for e in recomputed.episodes.records]
    assert cached.logprobs.old.dtype == torch.float64
    diff = (cached.logprobs.old - recomputed.logprobs.old).abs().max().item()
    assert diff <= TOL, diff
    # and both are the learner's log-probs of the stored ids (one forward, no cache)
    with torch.no_grad():
        learner = learner_forward(model, cached.input_ids, cached.attention_mask,
                                  cached.prompt_len).logp * cached.mask
    assert (learner.double() - cached.logprobs.old).abs().max().item() <= TOL


def test_turns_with_room_left_in_the_cache_equal_recomputed_turns(models, tok):
    """30 new tokens a turn leave the sampler's preallocated cache room to spare; the next
    turn compacts and extends the rows (cut at different lengths, one observation token),
    and must not write through the old room (it did: 0.24 off on turn 2)."""
    model, out = models["llama"], {}
    for name, sampler in (("cached", CachedTurns), ("recompute", Recompute)):
        turns = sampler(model, tok.pad_token_id, "past_key_values")
        torch.manual_seed(0)
        contexts, logps = [tok("1 2 +")["input_ids"], tok("3 *")["input_ids"]], []
        for _ in range(3):
            new, lp = turns(["a", "b"], contexts, 30, 1.0, 0, [-1])      # no stop id: 30 tokens
            logps.append(lp)
            contexts = [c + n[:3 + 7 * i] + tok("1")["input_ids"][-1:]
                        for i, (c, n) in enumerate(zip(contexts, new))]
        out[name] = contexts, logps
    (ctx_a, lp_a), (ctx_b, lp_b) = out["cached"], out["recompute"]
    assert ctx_a == ctx_b
    assert max(abs(a - b) for ta, tb in zip(lp_a, lp_b) for ra, rb in zip(ta, tb)
               for a, b in zip(ra, rb)) <= TOL


def test_greedy_episodes_agree_too(models, tok):
    """Eval plays greedy (top-k 1): the same tokens either way."""
    model = models["llama"]
    s = dict(group_size=1, max_new_tokens=5, temperature=1.0, max_turns=6, max_tokens=60)
    batches = []
    for reuse in (True, False):
        offsets = itertools.count()
        task = EnvTask("varied", lambda: Varied(next(offsets)), ROWS, ROWS)
        batches.append(EpisodePlayer(tok, task, *player_settings(**s, kv_reuse=reuse),
                                     (tok.eos_token_id,)).play(model, ROWS, seed=0, greedy=True))
    assert torch.equal(batches[0].input_ids, batches[1].input_ids)
    assert (batches[0].logprobs.old - batches[1].logprobs.old).abs().max().item() <= TOL


@pytest.mark.parametrize("name, reason", [
    ("recurrent_gemma", "keeps its recurrent state in its modules"),
    ("mistral", "DynamicSlidingWindowLayer"),
    ("lfm2", "LinearAttentionLayer"),
])
def test_models_whose_cache_sees_gaps_recompute(tok, name, reason, caplog, monkeypatch):
    """The reason is said in one line (once per process) and the turns recompute."""
    model = _hf(name, tok)
    assert reason in gaps_unsupported(model)
    monkeypatch.setattr(kv_share, "_said", set())
    with caplog.at_level(logging.WARNING, logger="rlctl.models.kv_share"):
        assert isinstance(turn_sampler(model, tok.pad_token_id), Recompute)
        assert isinstance(turn_sampler(model, tok.pad_token_id), Recompute)
    lines = [r.getMessage() for r in caplog.records if "recomputes its whole context" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0], lines
    if name == "recurrent_gemma":       # and it still plays: exactly the recompute path
        a, b = _play(model, tok, True, max_turns=3), _play(model, tok, False, max_turns=3)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logprobs.old, b.logprobs.old)
        assert all(e.turns >= 1 for e in a.episodes.records)


def test_kv_reuse_false_is_the_recompute_path(models, tok):
    assert isinstance(turn_sampler(models["llama"], tok.pad_token_id, kv_reuse=False), Recompute)


class Echo:
    """Answers every turn with five tokens and never ends: episodes run into the context."""

    def reset(self, example, seed):
        return example.prompt

    def step(self, turn):
        return Step(observation="1 2 3 4 5", reward=1.0)


def test_episodes_reaching_the_context_at_different_turns(models, tok):
    """GPT-2's positions are a table of n_positions = 64 rows. Prompts of 4 to 34 tokens
    reach the context at different turns, so the turn sampled for all rows at once runs
    past some rows' last position (their room is shorter than the others'); those tokens
    are dropped, but feeding them must not index position 64 (was: IndexError). Every row
    ends length_limit within the context, both paths alike, the learner's log-probs equal."""
    model = models["gpt2"]
    context = model.config.n_positions
    rows = [Example("1 2 +")] + [Example(" ".join(["7"] * n)) for n in range(28, 34)]
    s = dict(group_size=1, max_new_tokens=8, temperature=1.0, max_turns=20, max_tokens=200,
             max_obs_tokens=16)
    batches = []
    for reuse in (True, False):
        torch.manual_seed(0)
        task = EnvTask("echo", Echo, rows, rows)
        batches.append(EpisodePlayer(tok, task, *player_settings(**s, kv_reuse=reuse),
                                     (tok.eos_token_id,)).play(model, rows, seed=0))
    cached, recomputed = batches
    assert [e.status for e in cached.episodes.records] == ["length_limit"] * len(rows)
    assert int(cached.attention_mask.sum(-1).max()) <= context
    assert torch.equal(cached.input_ids, recomputed.input_ids)
    assert (cached.logprobs.old - recomputed.logprobs.old).abs().max().item() <= TOL
    with torch.no_grad():
        learner = learner_forward(model, cached.input_ids, cached.attention_mask,
                                  cached.prompt_len).logp * cached.mask
    assert (learner.double() - cached.logprobs.old).abs().max().item() <= TOL
