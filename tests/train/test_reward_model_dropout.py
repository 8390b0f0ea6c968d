"""`rlctl reward-model train` fits with the base model's dropout off (``model.disable_dropout``,
default true, as for `rlctl train`; TRL's reward trainer disables it too), so the
Bradley-Terry loss of a training step is the loss of the function that is later scored in
eval mode.

Base: a random-init GPT-2 (GPT2Config's resid/embd/attn pdrop 0.1). One step of 8 pairs
(all of them in the batch: held-out pairs come from --eval), rm.center_coef=0, so the
logged train/loss of step 1 is mean softplus(r_rejected - r_chosen) over the 8 pairs at the
initial weights. Reference: the same classifier (same seed, so the same new score head)
scored in eval mode, the loss by hand. Bound: both are float32 forwards of the same 16
texts in one padded batch, the same operations per row (only the row order differs, so
at most the kernels' blocking and the 8-term mean's order change): a score of this head
(|r| ~ 1e-2, H = 64) moves by a few ulps of its partial sums, ~1e-7, and the mean of
softplus (slope <= 1) by no more, plus 8 u * 0.7 ~ 3e-7 for the mean's order; 1e-5 is
well above that (measured: 6e-8). With dropout kept (the old fit) the step-1 loss differs
by 1.8e-3 on this model (measured); the second test asserts > 2e-4 with
model.disable_dropout=false, so dropout left on fails the first."""
import json
import os
import sys

import pytest
import torch
import transformers as tf

from rlctl.rm.fit import Pair, classifier_from_lm, pair_scores, prepare_for_scoring
from rlctl.rm.training import train_reward_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from real_arch import build_tokenizer  # noqa: E402

BOUND = 1e-5          # float32, derived above


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_dropout")
    tok = build_tokenizer("gpt2")
    conf = tf.GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=64, n_layer=2, n_head=4,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    assert (conf.resid_pdrop, conf.embd_pdrop, conf.attn_pdrop) == (0.1, 0.1, 0.1)
    torch.manual_seed(0)
    ckpt = root / "gpt2"
    tf.GPT2LMHeadModel(conf).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    rows = [{"prompt": f"{a} {b} =", "chosen": f"{min(a, b)} {max(a, b)}",
             "rejected": f"{max(a, b)} {min(a, b)}"} for a, b in
            [(1, 5), (7, 2), (3, 9), (8, 4), (6, 0), (2, 3), (9, 1), (4, 7)]]
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, ckpt, prefs, [Pair(r["prompt"], r["chosen"], r["rejected"]) for r in rows]


def _first_loss(root, ckpt, prefs, *extra) -> float:
    run_dir = train_reward_model(
        ["model=hf", f"model.name_or_path={ckpt}", f"run.output_dir={root / 'runs'}",
         "rm.steps=1", "rm.batch_size=8", "rm.center_coef=0", "rm.eval_every=0",
         "logger.console=false", *extra], str(prefs), eval_prefs=str(prefs))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["train/loss"] for r in rows if r.get("step") == 1 and "train/loss" in r)


def _eval_mode_loss(ckpt, pairs) -> float:
    model = classifier_from_lm(str(ckpt), torch.float32, seed=0).eval()   # config.yaml seed 0
    tok = tf.AutoTokenizer.from_pretrained(str(ckpt))
    prepare_for_scoring(model, tok)
    with torch.no_grad():
        r_c, r_r = pair_scores(model, tok, pairs)                          # [8], [8]
    return float(torch.nn.functional.softplus(r_r - r_c).mean())


def test_the_fit_scores_with_dropout_off(setup):
    root, ckpt, prefs, pairs = setup
    assert abs(_first_loss(root, ckpt, prefs) - _eval_mode_loss(ckpt, pairs)) <= BOUND


def test_disable_dropout_false_keeps_the_base_models_dropout(setup):
    root, ckpt, prefs, pairs = setup
    kept = _first_loss(root, ckpt, prefs, "model.disable_dropout=false")
    assert abs(kept - _eval_mode_loss(ckpt, pairs)) > 2e-4
