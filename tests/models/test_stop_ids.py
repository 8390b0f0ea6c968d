"""The stop set (rlctl/models/stop_ids.py) and where it is used: masks and ``truncated``
with a stop id equal to the pad id, the lean sampler, decoded text, the audit, and the
sampler's memory (behaviour log-probs [N, T] only)."""
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from real_arch import SPECS, build_tokenizer

from rlctl.commands.audit.rows import stop_set
from rlctl.core.logprobs import completion_mask
from rlctl.errors import UserError
from rlctl.models.kv_share import cache_keyword
from rlctl.models.stop_ids import (decode_completions, parse_stop_override,
                                   resolve_stop_ids, stop_ids)
from rlctl.rollout.generate import rollout
from rlctl.rollout.generate import sample
from rlctl.types import Example

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")


@pytest.fixture(scope="module")
def family():
    """name -> (stand-in model with the family's generation config, tokenizer)."""
    made = {}

    def get(name):
        if name not in made:
            tok = build_tokenizer(name)
            stops = [tok.convert_tokens_to_ids(t) for t in SPECS[name]["stops"]]
            gen = GenerationConfig(eos_token_id=stops if len(stops) > 1 else stops[0])
            made[name] = (SimpleNamespace(generation_config=gen), tok)
        return made[name]
    return get


def _id(tok, token):
    return tok.convert_tokens_to_ids(token)


def test_qwen2_two_stop_ids_and_the_pad_id_is_one(family):
    model, tok = family("qwen2")
    want = (_id(tok, "<|im_end|>"), _id(tok, "<|endoftext|>"))   # tokenizer EOS first
    assert stop_ids(model, tok) == want and tok.pad_token_id == want[1]


def test_llama3_three_stop_ids(family):
    model, tok = family("llama")
    want = tuple(_id(tok, t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))
    assert stop_ids(model, tok) == want and tok.eos_token_id == want[0]


def test_gpt2_single_id_and_no_generation_config(family):
    model, tok = family("gpt2")
    assert stop_ids(model, tok) == (tok.eos_token_id,)
    assert stop_ids(SimpleNamespace(), tok) == (tok.eos_token_id,)   # no generation config


def test_override_by_string_and_id_is_added_and_written_back(family):
    model, tok = family("qwen2")
    model = SimpleNamespace(generation_config=GenerationConfig(**model.generation_config.to_dict()))
    start = _id(tok, "<|im_start|>")
    got = resolve_stop_ids(model, tok, ["<|im_start|>", 7, _id(tok, "<|im_end|>")])
    assert got == (_id(tok, "<|im_end|>"), _id(tok, "<|endoftext|>"), start, 7)
    assert model.generation_config.eos_token_id == list(got)    # every later reader sees it
    assert stop_ids(model, tok) == got


@pytest.mark.parametrize("bad,words", [
    ("<|not_a_token|>", "not a token of the model's vocabulary"),
    (10 ** 6, "token ids must be in [0, "), (-1, "token ids must be in [0, "),
    (1.5, "each entry is a token id (int) or a token string"),
    (True, "each entry is a token id (int) or a token string")])
def test_bad_override_is_one_line(family, bad, words):
    _, tok = family("qwen2")
    with pytest.raises(UserError) as err:
        parse_stop_override(tok, [bad])
    msg = str(err.value)
    assert words in msg and "\n" not in msg and "rollout.stop_token_ids" in msg


def test_mask_and_truncated_with_a_stop_id_equal_to_pad():
    """Qwen2's shape: pad 5 is also a stop id (stops 4, 5). Hand-worked rows."""
    ids = torch.tensor([[1, 5, 5, 5],     # ends at the pad-valued stop id: counted once
                        [5, 5, 5, 5],     # the first token is the stop
                        [1, 2, 4, 5],     # the other stop id, then padding
                        [1, 2, 3, 1]])    # no stop id: truncated, all 4 tokens count
    mask, truncated = completion_mask(ids, (4, 5), pad_id=5)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, False, True]


def test_decoded_text_drops_the_stop_even_when_not_special(family):
    _, tok = family("qwen2")
    a = tok("12", add_special_tokens=False)["input_ids"]
    stop, pad = _id(tok, "<|endoftext|>"), tok.pad_token_id
    plain = tok("x", add_special_tokens=False)["input_ids"][0]     # an ordinary token as a stop
    rows = torch.tensor([a + [stop, pad, pad], a + [plain, pad, pad]])
    mask, _ = completion_mask(rows, (stop, plain))
    assert decode_completions(tok, rows, mask, (stop, plain)) == ["12", "12"]


def test_audit_checks_against_the_stop_set():
    assert stop_set({"eos_token_id": 3, "stop_token_ids": [3, 9]}) == {3, 9}
    assert stop_set({"eos_token_id": 3}) == {3}
    assert stop_set({"stop_token_ids": [3, "x"]}) == frozenset()


class _Watched(torch.nn.Module):
    """The tiny model, with a weak reference kept to every step's logits [N, ., V]; the
    most that were alive at once shows whether the sampler holds earlier steps' rows."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.refs, self.most_alive = inner, [], 0

    def forward(self, **kw):
        self.most_alive = max(self.most_alive, sum(r() is not None for r in self.refs))
        out = self.inner(**kw)
        self.refs.append(weakref.ref(out.logits))
        return out


def test_sampler_stops_at_every_stop_id_and_keeps_only_token_logprobs(tiny):
    """A digit made a stop id ends rows early (rows padded after it); with behaviour
    log-probs on, only [N, T] comes back and no step's [N, ., V] logits outlive its step."""
    model, tok = tiny
    enc = tok(["3 1 4 ="] * 6, return_tensors="pt", padding=True)
    digit = tok.convert_tokens_to_ids("1")
    stops = (tok.eos_token_id, digit)
    watched = _Watched(model)
    torch.manual_seed(0)
    seqs, logp = sample(watched, enc["input_ids"], enc["attention_mask"], 8, 1.0, 0, stops,
                        tok.pad_token_id, cache_keyword(model), keep_logprobs=True)
    new = seqs[:, enc["input_ids"].shape[1]:]                                   # [6, T]
    assert logp.shape == new.shape and logp.dtype == torch.float32 and (logp <= 0).all()
    assert watched.most_alive <= 1 and len(watched.refs) == new.shape[1]
    mask, truncated = completion_mask(new, stops)
    ended = ~truncated
    assert ended.any() and (new == digit).any()                    # the digit did stop rows
    for row, m in zip(new.tolist(), mask.sum(-1).long().tolist()):
        assert all(t == tok.pad_token_id for t in row[m:])          # nothing after the end
    no_keep = sample(model, enc["input_ids"], enc["attention_mask"], 8, 1.0, 0, stops,
                     tok.pad_token_id, cache_keyword(model))[1]
    assert no_keep is None                                          # nothing kept unasked


def test_rollout_uses_the_resolved_set(tiny):
    """``rollout`` reads the stop set from the model's generation config (as the training
    source resolves it): a digit added as a stop id ends completions, counted once."""
    model, tok = tiny
    digit = tok.convert_tokens_to_ids("1")
    saved = model.generation_config.eos_token_id
    try:
        stops = resolve_stop_ids(model, tok, ["1"])
        assert stops == (tok.eos_token_id, digit)
        torch.manual_seed(1)
        b = rollout(model, tok, [Example("3 1 4 =")], 8, 8, 1.0, 0, lambda ex, c: [0.0] * len(c))
    finally:
        model.generation_config.eos_token_id = saved
    ids, n = b.completion_ids.tolist(), b.mask.sum(-1).long().tolist()
    for row, m, trunc, text in zip(ids, n, b.truncated.tolist(), b.completions):
        first = next((i for i, t in enumerate(row) if t in stops), None)
        assert trunc == (first is None) and m == (len(row) if first is None else first + 1)
        assert "1" not in text.split()                               # the stop is not in the text
    assert not all(b.truncated.tolist())


def test_cli_bad_stop_override_is_one_line(real_arch, tmp_path):
    out = subprocess.run([RLCTL, "eval", str(real_arch("qwen2")), "rollout.stop_token_ids=[nope]",
                          "task.num_eval=2", "task.prompt_format=chat"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "rollout.stop_token_ids" in lines[-1] \
        and "'nope'" in lines[-1], out.stderr
