"""The one reward-model scoring path (rlctl.rm.learned: render, text_scores),
which `rlctl reward-model train` fits with (rlctl.rm.fit) and a run's reward
scorer reads with (RewardModel): same text, same tokens, same read-out."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlctl.demo import tiny
from rlctl.rm.fit import pair_scores, scores, Pair
from rlctl.rm.learned import RewardModel
from rlctl.rm.score import keep_end, render, text_scores
from rlctl.types import Example

CHAT = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
PROMPTS = ["3 1 4 =", "9 =", "2 7 1 8 2 8 ="]
COMPLETIONS = ["1 3 4", "9 9 9 9 9 9 9", "1"]


def _tokenizer(chat=False, eos_pad=False):
    tok = tiny.build_tokenizer()
    if chat:
        tok.chat_template = CHAT
    if eos_pad:
        tok.pad_token = tok.eos_token
    return tok


def _classifier(tok, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, pad_token_id=tok.pad_token_id, num_labels=1)
    return LlamaForSequenceClassification(cfg).to(dtype).eval()


def _alone(model, tok, text):
    """One unpadded row: the head at its last position (hand-indexed, no pooling code)."""
    ids = tok(text, return_tensors="pt", add_special_tokens=not tok.chat_template)["input_ids"]
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state          # [1, L, H]
        return float(model.score(h[0, -1]))


def test_render_hand_cases():
    plain, chat = _tokenizer(), _tokenizer(chat=True)
    assert render(plain, "5 =", "1 2") == "5 = 1 2"         # a space where neither side has one
    assert render(plain, "5 = ", "1 2") == "5 = 1 2"        # no second space
    assert render(plain, "Q:", " yes") == "Q: yes"           # a BPE-style leading space kept
    assert render(plain, "", "1") == "1" and render(plain, "5 =", "") == "5 ="
    assert render(chat, "3 1 =", "1 3") == "<user> 3 1 = <eos> <assistant> 1 3 <eos> "
    msgs = [{"role": "system", "content": "sort"}, {"role": "user", "content": "2 1 ="}]
    assert render(chat, msgs, "1 2") == ("<system> sort <eos> <user> 2 1 = <eos> "
                                         "<assistant> 1 2 <eos> ")


def test_training_and_run_scoring_give_the_same_numbers(tmp_path):
    tok = _tokenizer()
    model = _classifier(tok)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = RewardModel(tmp_path / "rm")
    examples = [Example(prompt=p, fields={}) for p in PROMPTS]
    run_side = rm.score(examples, COMPLETIONS)                 # a run's reward scorer
    with torch.no_grad():
        fit_side = scores(model, tok, PROMPTS, COMPLETIONS).tolist()   # what fit() trains
        c, r = pair_scores(model, tok, [Pair(PROMPTS[0], COMPLETIONS[0], COMPLETIONS[1])])
    assert run_side == fit_side                    # one code path, same float64 weights
    # against one unpadded row each; float64 but Llama's rotary tables are float32, so a
    # token at another absolute position (left padding) rounds differently: ~1e-9
    want = [_alone(model, tok, render(tok, p, x)) for p, x in zip(PROMPTS, COMPLETIONS)]
    np.testing.assert_allclose(fit_side, want, rtol=0, atol=1e-8)
    assert float(c) == pytest.approx(want[0], abs=1e-8)
    assert float(r) == pytest.approx(_alone(model, tok, render(tok, PROMPTS[0], COMPLETIONS[1])),
                                     abs=1e-8)


@pytest.mark.parametrize("side", ["left", "right"])
def test_eos_as_pad_reads_where_transformers_pools(side):
    """With EOS as the pad token and a chat template ending every turn in EOS, the fit's
    scoring path reads the token transformers' pooling reads (the last token that is not
    the pad id: the one before the final EOS), as a plain transformers forward of each
    unpadded row gives it; the final EOS itself (read before) gives other numbers."""
    tok = _tokenizer(chat=True, eos_pad=True)
    tok.padding_side = side
    model = _classifier(tok)
    texts = [render(tok, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    with torch.no_grad():
        got = text_scores(model, tok, texts).tolist()
        stock = [float(model(input_ids=tok(t, return_tensors="pt", add_special_tokens=False)[
            "input_ids"]).logits[0, 0]) for t in texts]        # transformers, one row each
    np.testing.assert_allclose(got, stock, rtol=0, atol=1e-8)   # as above
    at_eos = [_alone(model, tok, t) for t in texts]
    assert max(abs(a - b) for a, b in zip(at_eos, stock)) > 1e-4  # the choice matters here


def _head_at_end(model, ids):
    """The head at the last position of one unpadded row of ``ids`` (hand-picked tokens)."""
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([ids])).last_hidden_state   # [1, len, H]
        return float(model.score(h[0, -1]))


def test_keep_end_hand_cases():
    bos = 1
    assert keep_end([1, 2, 3, 4, 5], 3, bos) == [1, 4, 5]      # BOS first, then the end
    assert keep_end([2, 3, 4, 5], 3, bos) == [3, 4, 5]         # no BOS: the last 3
    assert keep_end([1, 2, 3], 3, bos) == [1, 2, 3]            # within the limit: whole
    assert keep_end([1, 2, 3], 1, bos) == [3]                  # no room for BOS and text
    assert keep_end([1, 2, 3], None, bos) == [1, 2, 3]


def test_an_over_long_text_is_scored_at_its_last_token():
    """Was test_max_length_truncates_as_the_first_tokens_alone: the text over the limit kept
    its first tokens, so the score was read at a prompt token and every answer to a long
    prompt scored alike. Now it keeps its BOS and its last tokens, the completion's end, and
    the score equals the head over exactly those tokens (built by hand from the ids)."""
    tok = _tokenizer()
    model = _classifier(tok)
    prompt = "2 7 1 8 2 8 1 8 2 8 4 5 9 0 4 5 ="                 # 18 tokens with BOS
    texts = [render(tok, prompt, c) for c in ("0 1 1 2 2", "9 8 8 8 7")]
    ids = [tok(t)["input_ids"] for t in texts]
    assert ids[0][0] == tok.bos_token_id and len(ids[0]) == 23
    k = 8
    with torch.no_grad():
        got = text_scores(model, tok, texts + ["9 = 9"], max_length=k).tolist()
    want = [_head_at_end(model, [tok.bos_token_id] + r[-(k - 1):]) for r in ids]
    assert tok.convert_ids_to_tokens(ids[0][-(k - 1):])[-5:] == "0 1 1 2 2".split()
    np.testing.assert_allclose(got[:2], want, rtol=0, atol=1e-8)   # float64, as above
    assert abs(got[0] - got[1]) > 1e-4          # the answers differ, and so do the scores
    # the first k tokens (the old rule) read a prompt token: the same ids, the same score
    old = [_head_at_end(model, r[:k]) for r in ids]
    assert old[0] == old[1] and abs(got[0] - old[0]) > 1e-4


def test_run_scoring_keeps_the_same_end_and_counts_it(tmp_path, caplog):
    """RewardModel (a run's scorer) reads the limit saved in the tokenizer and keeps the
    same tokens as the fit; texts over it (only those: the second text, 7 tokens, is
    exactly at the limit) are counted and warned about once."""
    tok = _tokenizer(chat=True)               # a template: no tokenizer BOS, the last k ids
    model = _classifier(tok)
    tok.model_max_length = 7
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = RewardModel(tmp_path / "rm")
    assert rm.limit == 7
    texts = [render(tok, "3 1 4 1 5 9 2 6 =", "1 1 2 3 4 5 6 9"), render(tok, "9 =", "9")]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len(ids[0]) > 7 and tok.convert_ids_to_tokens(ids[0][-2:]) == ["9", "<eos>"]
    with caplog.at_level("WARNING", logger="rlctl.rm.learned"):
        got = rm.score_texts(texts)
        again = rm.score_texts(texts[:1])
    want = _head_at_end(model, ids[0][-7:])
    assert got[0] == pytest.approx(want, abs=1e-8) and again[0] == pytest.approx(want, abs=1e-8)
    assert len(ids[1]) == 7 and rm.truncated == 2         # text 1 twice; text 2 fits
    warned = [r.getMessage() for r in caplog.records if "7-token limit" in r.getMessage()]
    assert len(warned) == 1 and "1 of 2 texts" in warned[0], warned


def test_the_help_says_what_null_max_length_means_and_it_does():
    """rm.max_length's help (the comment above it in RMConfig) names null's meaning (the
    model's context, not "no limit"), and with null a text past the tiny model's 64
    positions is scored at its last 64 tokens, as the comment says."""
    import rlctl.rm.settings as rm_conf

    lines = [ln.strip() for ln in Path(rm_conf.__file__).read_text().splitlines()]
    at = next(i for i, ln in enumerate(lines) if ln.startswith("max_length:"))
    comment = " ".join(ln.lstrip("# ") for ln in lines[at - 4:at] if ln.startswith("#"))
    assert "null: the model's context" in comment and "no limit" not in comment
    assert "last max_length tokens" in comment and "Saved with the model" in comment
    tok = _tokenizer()
    model = _classifier(tok)                       # max_position_embeddings=64
    assert tok.model_max_length == 64
    text = render(tok, " ".join(["7"] * 70) + " =", "1 2")
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        got = float(text_scores(model, tok, [text])[0])
    assert got == pytest.approx(_head_at_end(model, ids[:1] + ids[-63:]), abs=1e-8)
