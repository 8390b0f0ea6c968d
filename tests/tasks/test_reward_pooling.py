"""Where a reward model's score is read, against a plain transformers forward
(``AutoModelForSequenceClassification`` on the same texts): a checkpoint whose pad id is
its EOS, with texts that end with that EOS, scores as transformers scores it (the last
token that is not the pad id), with right and left padding; a model fitted by
`rlctl reward-model train` is read at the token it was fitted at, which is
transformers' too; a model fitted by an earlier rlctl (no read key in its config) keeps
the last-token read it was fitted with, and says so once."""
import json
import logging

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification, PreTrainedTokenizerFast)

from rlctl.demo import tiny
from rlctl.rm.score import LAST_ATTENDED, LAST_NON_PAD, READ_KEY
from rlctl.rm.fit import scores as fit_scores
from rlctl.rm.learned import RewardModel

PAIRS = [("3 1 4 =", "1 3 4"), ("9 =", "9 9"), ("2 7 1 8 2 8 =", "1 2 2 7 8 8"), ("5 =", "")]
TEXTS = [f"{p} {c}".strip() for p, c in PAIRS]       # render()'s join of prompt and answer


def eos_pad_tokenizer(side="right"):
    """Word-level over the tiny model's symbols; every text gets '<bos> ... <eos>' and the
    pad token IS the EOS (as GPT-2, Llama and many TRL reward models are set up)."""
    vocab = {t: i for i, t in enumerate(["<eos>", "<bos>", "<unk>"] + list(tiny.SYMBOLS))}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 1), ("<eos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<eos>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side=side)


def _config(tok, **kw):
    return LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=64, pad_token_id=tok.pad_token_id, **kw)


def hf_scores(path, tok, texts):
    """transformers' own forward and pooling on the padded batch (position ids counted over
    the mask, which a left-padded batch needs and a right-padded one does not change)."""
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    enc = tok(list(texts), return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"], attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    return out.logits[:, 0].double().numpy()


def last_token_reference(path, tok, texts):
    """head(final hidden state at each text's last token), from transformers' forward."""
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tok(t, return_tensors="pt")["input_ids"]
            h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
            out.append(float(model.score(h)))
    return np.array(out)


@pytest.mark.parametrize("side", ["right", "left"])
def test_an_external_pad_eos_model_scores_as_transformers_does(tmp_path, side):
    tok = eos_pad_tokenizer(side)
    torch.manual_seed(0)
    LlamaForSequenceClassification(_config(tok, num_labels=1)).double().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rm = RewardModel(tmp_path)
    assert rm.tokenizer.padding_side == side and rm.read == LAST_NON_PAD
    assert all(tok(t)["input_ids"][-1] == tok.pad_token_id for t in TEXTS)   # ends with EOS
    got = np.array(rm.score_texts(TEXTS))
    want = hf_scores(tmp_path, tok, TEXTS)
    # float64 weights; Llama's rotary tables are float32, so a token at another absolute
    # position rounds differently (measured 7e-10 in test_reward_model.py): 1e-8 holds
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-8)
    # the trailing EOS (what was read before) gives other scores: the check can fail
    assert np.abs(last_token_reference(tmp_path, tok, TEXTS) - want).min() > 1e-4


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """`rlctl reward-model train` (in-process CLI) on a base LM whose pad is its EOS."""
    from typer.testing import CliRunner

    from rlctl.cli import app

    root = tmp_path_factory.mktemp("pool")
    tok = eos_pad_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(_config(tok)).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    rows = [{"prompt": f"{a} {b} =", "chosen": f"{min(a, b)} {max(a, b)}",
             "rejected": f"{max(a, b)} {min(a, b)}"} for a in range(1, 6) for b in range(6, 9)]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(app, ["reward-model", "train", str(root / "p.jsonl"), "model=hf",
                                   f"model.name_or_path={root / 'base'}", "rm.steps=3",
                                   "rm.lr=1e-3", "logger=jsonl", "logger.console=false",
                                   f"run.output_dir={root / 'runs'}"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (run,) = (root / "runs").iterdir()
    return run, tok


def test_an_rlctl_fit_is_read_where_it_was_fitted_and_transformers_reads_it(fitted):
    run, tok = fitted
    saved = json.loads((run / "model" / "config.json").read_text())
    assert saved[READ_KEY] == LAST_NON_PAD and saved["pad_token_id"] == tok.eos_token_id
    want = hf_scores(run / "model", tok, TEXTS)
    for side in ("right", "left"):
        rm = RewardModel(run / "model")
        rm.tokenizer.padding_side = side
        # float32 forwards of the same ids and positions; only the order of the head's
        # products may differ (a [n, H] row vs the [n, L, H] batch): 1e-5 on O(1) scores
        np.testing.assert_allclose(rm.score_texts(TEXTS), want, rtol=0, atol=1e-5)
    # the fit's own scoring path (reward_fit.scores) reads the same token
    model = AutoModelForSequenceClassification.from_pretrained(str(run / "model")).eval()
    with torch.no_grad():
        fit = fit_scores(model, tok, *map(list, zip(*PAIRS))).numpy()
    np.testing.assert_allclose(fit, want, rtol=0, atol=1e-5)


def test_an_earlier_rlctl_fit_keeps_its_last_token_read_and_says_so(fitted, tmp_path, caplog):
    import shutil

    run, tok = fitted
    old = tmp_path / "old-rm"
    shutil.copytree(run, old)
    conf = json.loads((old / "model" / "config.json").read_text())
    del conf[READ_KEY]                        # as `rlctl reward-model train` wrote it before
    (old / "model" / "config.json").write_text(json.dumps(conf))
    rm = RewardModel(old / "model")
    assert rm.read == LAST_ATTENDED
    with caplog.at_level(logging.WARNING, logger="rlctl.rm.learned"):
        got = rm.score_texts(TEXTS)
        rm.score_texts(TEXTS)
    notes = [r for r in caplog.records if "as it was fitted" in r.getMessage()]
    assert len(notes) == 1 and "earlier rlctl" in notes[0].getMessage()
    np.testing.assert_allclose(got, last_token_reference(old / "model", tok, TEXTS),
                               rtol=0, atol=1e-5)    # float32, as above
