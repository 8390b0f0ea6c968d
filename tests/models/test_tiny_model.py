"""The embedded tiny model: deterministic cached build, format-but-not-skill warm start
and left padding, measured with the one greedy decoder and evaluator
(rlctl.rollout.generate.generate with do_sample=False; rlctl.train.evaluate)."""
import threading

import pytest
import torch

from rlctl.demo import tiny
from rlctl.core.logprobs import completion_mask
from rlctl.train.evaluate import evaluate, means
from rlctl.demo.tiny import build_params, build_tiny, cache_key
from rlctl.rollout.generate import decode_completions, generate
from rlctl.tasks.scoring import RewardScorer
from rlctl.tasks.sorting import SortingTask

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, warmup_steps=3, warmup_lr=1e-3)


def _state(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_two_builds_are_identical(tmp_path):
    a = build_tiny(**SMALL, cache_dir=tmp_path / "a")
    b = build_tiny(**SMALL, cache_dir=tmp_path / "b")
    assert a.name == b.name
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    other = build_tiny(**dict(SMALL, seed=1), cache_dir=tmp_path / "a")
    assert other != a
    assert not torch.equal(_state(other)["model.embed_tokens.weight"],
                           sa["model.embed_tokens.weight"])


def test_cache_hit_does_not_rebuild(tmp_path, monkeypatch):
    first = build_tiny(**SMALL, cache_dir=tmp_path)
    monkeypatch.setattr(tiny, "_build_into", lambda *a, **k: pytest.fail("rebuilt"))
    assert build_tiny(**SMALL, cache_dir=tmp_path) == first
    monkeypatch.setenv("RLCTL_CACHE", str(tmp_path))
    assert build_tiny(**SMALL) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no temp dirs left


def test_cache_key_covers_every_parameter():
    base = build_params(**SMALL)
    keys = {cache_key(base)}
    for name, value in [("hidden_size", 64), ("num_layers", 2), ("num_heads", 4),
                        ("warmup_steps", 4), ("warmup_lr", 2e-3), ("seed", 1),
                        ("warmup_num_digits", 4)]:
        keys.add(cache_key(build_params(**dict(SMALL, **{name: value}))))
    assert len(keys) == 8
    assert base["code_version"] == tiny.CODE_VERSION


def test_concurrent_builders_race_safely(tmp_path, monkeypatch):
    """Both builders finish building before either renames: one wins, one discards."""
    barrier, real = threading.Barrier(2, timeout=120), tiny._build_into

    def slow_build(directory, params):
        meta = real(directory, params)
        barrier.wait()
        return meta

    monkeypatch.setattr(tiny, "_build_into", slow_build)
    results, errors = [], []

    def run():
        try:
            results.append(build_tiny(**SMALL, cache_dir=tmp_path))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].name]
    assert (results[0] / "model.safetensors").is_file()


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(directory, params):
        (directory / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(tiny, "_build_into", broken)
    with pytest.raises(RuntimeError, match="boom"):
        build_tiny(**SMALL, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_saved_files(tiny_dir, tiny_cfg):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "rlctl_tiny.json"} <= names
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        tiny_cfg["hidden_size"], tiny_cfg["num_layers"], tiny_cfg["num_heads"])
    assert cfg.intermediate_size == 2 * cfg.hidden_size and cfg.max_position_embeddings == 64


def greedy_texts(model, tok, prompts, max_new_tokens=8):
    """(texts, ended with a stop id) of the one greedy decoder."""
    seqs, _, plen = generate(model, tok, prompts, max_new_tokens, do_sample=False,
                             share_prompts=False)
    stops = (tok.eos_token_id,)
    mask, truncated = completion_mask(seqs[:, plen:], stops)
    return decode_completions(tok, seqs[:, plen:], mask, stops), (~truncated).tolist()


def held_out(model, tok, task, examples, **kwargs):
    """The evaluator's means, with the share of well-formed completions."""
    def well_formed(rows, texts, rewards):
        return {"well_formed": float(sum(task.is_well_formed(e, t) for e, t in zip(rows, texts)))}
    with RewardScorer(task) as scorer:
        ev = evaluate(model, tok, examples, scorer=scorer, max_new_tokens=kwargs.pop("max_new_tokens", 8),
                      extra=well_formed, **kwargs)
    return means({**ev.sums, **ev.extra})


def test_warm_start_knows_format_not_skill(tiny):
    """The calibrated start: answers are well formed, mostly not yet sorted."""
    model, tok = tiny
    task = SortingTask()
    m = held_out(model, tok, task, task.eval_examples())
    assert m["exact_match"] <= 0.3
    assert m["well_formed"] >= 0.9 and m["truncated_frac"] <= 0.1
    texts, ended = greedy_texts(model, tok, [e.prompt for e in task.eval_examples()[:32]])
    assert all(ended)
    assert all("=" not in t and "<" not in t for t in texts)  # completion only, no specials


def test_prompt_alone_equals_prompt_in_padded_batch(tiny):
    model, tok = tiny
    prompts = [e.prompt for e in SortingTask().eval_examples()[:6]]
    alone = [greedy_texts(model, tok, [p])[0][0] for p in prompts]
    batch = []
    for p in prompts:  # padded among a shorter and a longer prompt
        batch.append(greedy_texts(model, tok, ["2 7 =", p, "9 8 7 6 5 4 3 ="])[0][1])
    assert alone == batch


def test_held_out_exact_match_is_consistent(tiny):
    model, tok = tiny
    task = SortingTask()
    examples = task.eval_examples()[:40]
    texts, ended = greedy_texts(model, tok, [e.prompt for e in examples])
    exact = sum(task.is_correct(e, t) for e, t in zip(examples, texts))
    m = held_out(model, tok, task, examples)
    assert m["exact_match"] == pytest.approx(exact / 40)
    assert m["truncated_frac"] == pytest.approx(sum(not x for x in ended) / 40)
    assert held_out(model, tok, task, examples, batch_size=7) == m
    # too few new tokens for "d d d d d <eos>" (6 tokens): every completion is cut
    assert held_out(model, tok, task, examples, max_new_tokens=5)["truncated_frac"] == 1.0
    assert held_out(model, tok, task, []) == {"exact_match": 0.0, "reward": 0.0, "length_mean": 0.0,
                                              "truncated_frac": 0.0}
