"""The one reward-model scoring path (rlctl.tasks.reward_model: render, text_scores),
which `rlctl reward-model train` fits with (rlctl.models.reward_fit) and a run's reward
scorer reads with (RewardModel): same text, same tokens, same read-out."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlctl.models import tiny
from rlctl.models.reward_fit import pair_scores, scores, Pair
from rlctl.tasks.reward_model import RewardModel, render, text_scores
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
def test_eos_as_pad_still_reads_the_final_eos(side):
    """With EOS as the pad token and a chat template ending every turn in EOS, the score is
    the head at the final EOS (the mask's last 1), as an unpadded row reads it; the stock
    pooling by pad id would read the token before it."""
    tok = _tokenizer(chat=True, eos_pad=True)
    tok.padding_side = side
    model = _classifier(tok)
    texts = [render(tok, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    with torch.no_grad():
        got = text_scores(model, tok, texts).tolist()
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        stock = model(**enc).logits[:, 0].tolist()            # pooling by pad id
    want = [_alone(model, tok, t) for t in texts]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-8)   # as above
    assert max(abs(a - b) for a, b in zip(stock, want)) > 1e-4  # the choice matters here


def test_max_length_truncates_as_the_first_tokens_alone():
    tok = _tokenizer()
    model = _classifier(tok)
    text = render(tok, PROMPTS[2], COMPLETIONS[2])
    ids = tok(text)["input_ids"]
    k = len(ids) - 3
    with torch.no_grad():
        got = float(text_scores(model, tok, [text, "9 = 9"], max_length=k)[0])
        h = model.model(input_ids=torch.tensor([ids[:k]])).last_hidden_state   # [1, k, H]
        want = float(model.score(h[0, -1]))
    assert got == pytest.approx(want, abs=1e-8)
