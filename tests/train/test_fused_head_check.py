"""The fused LM head (rlctl/models/forward.py ``fused_head``) is checked at run time
(rlctl/models/head_check.py): models that transform the logits after the head fall back
to the full logits, so the learner's log-probs equal a plain transformers forward's, and
a model without a transform keeps the fused path.

Tiny random-init models whose logits are not ``lm_head(hidden_states[-1])``, each with
its transform set so that it shows at random-init logit sizes (|z| ~ 0.1-1, where a
soft-cap of 30 would be the identity to 1e-4): RecurrentGemma's ``logits_soft_cap``,
Falcon-H1's ``lm_head_multiplier``, Gemma-2's ``final_logit_softcapping``, Cohere's
``logit_scale`` (the old config-name check knew only these last two), and Gemma-4's
conditional-generation model whose soft-cap sits in the nested ``text_config``. The
plain Llama keeps the fused path (asserted: a test that always fell back would pass the
others). Falcon-H1 and RecurrentGemma run their reference PyTorch kernels on the CPU.

Reference: log_softmax of the model's own full logits, gathered at the completion tokens
(positions P-1 .. P+T-2), float64. The learner's full-logits path computes the same
numbers in the same order, and the fused path on the Llama sums the head's dot products
in chunks: both agree to float64 summation-order rounding, ~1e-14 on these sizes; 1e-10
is far above that and far below the transforms' effect (> 1e-2 per token)."""
import copy
import logging

import pytest
import torch
import transformers as tf

from rlctl.models.forward import fused_head, learner_forward
from rlctl.models import head_check
from rlctl.train.dryrun import _fused

V, P, T = 97, 6, 5
DIMS = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)

TRANSFORMED = {
    "recurrent_gemma": lambda: tf.RecurrentGemmaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=16,
        logits_soft_cap=0.5),
    "falcon_h1": lambda: tf.FalconH1Config(
        num_hidden_layers=2, lm_head_multiplier=0.25, mamba_d_ssm=32, mamba_n_heads=4,
        mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8, **DIMS),
    "gemma2": lambda: tf.Gemma2Config(num_hidden_layers=2, final_logit_softcapping=0.5, **DIMS),
    "cohere": lambda: tf.CohereConfig(num_hidden_layers=2, logit_scale=0.25, **DIMS),
    "gemma4_text_config": lambda: tf.Gemma4Config(
        text_config=dict(num_hidden_layers=2, final_logit_softcapping=0.5, **DIMS)),
}
TOL = dict(atol=1e-10, rtol=0)


def _model(config):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).double().eval()


def _batch(left_pad: bool = False):
    """Three rows; ``left_pad``: the second has 2 pad columns. (The transformed models run
    unpadded: RecurrentGemma does not mask pads, which rlctl handles by running rows
    unpadded, and Gemma-2's eager attention gives NaN on a left-padded row in a plain
    transformers forward, the reference here.)"""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (3, P + T), generator=g)                       # [N, P+T]
    attn = torch.ones_like(ids)
    if left_pad:
        attn[1, :2] = 0
    return ids, attn


def _reference_logp(model, ids, attn):
    """log pi(token t) from the model's own logits, [N, T]."""
    from rlctl.models.kv_share import position_ids_from_mask

    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1],
                       position_ids=position_ids_from_mask(attn[:, :-1])).logits    # [N, P+T-1, V]
    logp = torch.log_softmax(logits[:, P - 1:].double(), -1)                        # [N, T, V]
    return logp.gather(-1, ids[:, P:, None])[..., 0]                                 # [N, T]


def _counting(model):
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name", sorted(TRANSFORMED))
def test_a_logit_transform_falls_back_to_the_full_logits(name, caplog):
    model = _model(TRANSFORMED[name]())
    head_check._SAID.discard(type(model).__name__)  # said once per process: not by another test here
    assert fused_head(model) is not None          # structurally a plain Linear head: unchecked yet
    ids, attn = _batch()
    want = _reference_logp(model, ids, attn)
    calls = _counting(model)
    with caplog.at_level(logging.WARNING, logger=head_check.__name__):
        with torch.no_grad():
            got = learner_forward(model, ids, attn, P).logp                         # [N, T]
            first = len(calls)
            again = learner_forward(model, ids, attn, P).logp
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(again, want, **TOL)
    assert head_check.VERDICTS.get(model) is False and fused_head(model) is None
    lines = [r.getMessage() for r in caplog.records if r.name == head_check.__name__]
    assert len(lines) == 1 and "full logits" in lines[0], lines       # said once, one line
    assert first == 1 + (len(calls) - first)        # one check forward, in the first call only
    reference = copy.deepcopy(model)                 # a frozen copy (the KL reference): checked
    with caplog.at_level(logging.WARNING, logger=head_check.__name__), torch.no_grad():
        torch.testing.assert_close(learner_forward(reference, ids, attn, P).logp, want, **TOL)
    assert head_check.VERDICTS.get(reference) is False
    assert len([r for r in caplog.records if r.name == head_check.__name__]) == 1   # not said again


def test_plain_llama_keeps_the_fused_head():
    model = _model(tf.LlamaConfig(num_hidden_layers=2, **DIMS))
    ids, attn = _batch(left_pad=True)
    want = _reference_logp(model, ids, attn)
    got = learner_forward(model, ids, attn, P).logp
    torch.testing.assert_close(got.detach(), want, **TOL)
    assert head_check.VERDICTS.get(model) is True
    assert fused_head(model) is not None


def test_the_fused_path_differs_where_a_transform_is_not_caught():
    """Why the check matters: Gemma-2's hidden states through its plain head (what the
    fused path would score) give other log-probs than its own soft-capped logits."""
    from rlctl.core.logprobs import chunked_token_logprobs
    from rlctl.models.kv_share import position_ids_from_mask

    model = _model(TRANSFORMED["gemma2"]())
    ids, attn = _batch()
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], output_hidden_states=True,
                    position_ids=position_ids_from_mask(attn[:, :-1]))
        head = model.get_output_embeddings()
        fused, _ = chunked_token_logprobs(out.hidden_states[-1][:, P - 1:], head.weight, ids[:, P:])
    gap = (fused - _reference_logp(model, ids, attn)).abs().max().item()
    assert gap > 1e-2, gap


def test_bf16_autocast_keeps_a_plain_head_and_catches_a_real_sized_soft_cap():
    """Under the bf16 backend's autocast the model's own head rounds its inputs to bf16
    and the fused head does not: the tolerance (head_check's docstring) admits that for a
    plain Llama, and still catches Gemma-2's soft-cap of 30 at checkpoint-sized logits
    (the head scaled 30x so that |z| reaches ~24, where the cap moves a logit by ~4)."""
    from rlctl.dist.backends import BF16Autocast

    ids, attn = _batch(left_pad=True)
    llama = _model(tf.LlamaConfig(num_hidden_layers=2, **DIMS)).float()
    learner_forward(BF16Autocast(llama, "cpu"), ids, attn, P)
    assert head_check.VERDICTS.get(llama) is True
    gemma = _model(tf.Gemma2Config(num_hidden_layers=2, final_logit_softcapping=30.0, **DIMS)).float()
    with torch.no_grad():
        gemma.lm_head.weight.mul_(30)
    ids, attn = _batch()
    learner_forward(BF16Autocast(gemma, "cpu"), ids, attn, P)
    assert head_check.VERDICTS.get(gemma) is False


@pytest.mark.parametrize("kind", ["cohere", "llama"])
def test_bf16_a_mild_multiplier_at_a_real_width_is_caught_and_a_plain_head_kept(kind):
    """At H = 4096 under bf16 autocast the dot products' worst-case rounding bound admits
    |fused - own| up to ~1.6% of sum |w h|, which on random weights is about |z| itself:
    a logit multiplier of 0.8 (Cohere's logit_scale set so) stayed inside it and the learner
    kept the fused head (fails before: verdict True). The check also watches the head
    module's own input and output in the same forward (same arithmetic as the model's):
    the logits are 0.8 x the head's output, caught; a plain Llama at the same width is
    still kept (its logits are the head's output exactly)."""
    from rlctl.dist.backends import BF16Autocast

    common = dict(vocab_size=512, hidden_size=4096, intermediate_size=256, num_hidden_layers=1,
                  num_attention_heads=8, num_key_value_heads=8)
    conf = tf.CohereConfig(logit_scale=0.8, tie_word_embeddings=False, **common) \
        if kind == "cohere" else tf.LlamaConfig(**common)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(conf).eval()                     # float32
    ids = torch.randint(0, 512, (2, 12))                                          # [2, 12]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  position_ids=torch.arange(12).expand(2, 12))
    fused_head(BF16Autocast(model, "cpu"), inputs)
    assert head_check.VERDICTS.get(model) is (kind == "llama")


def test_the_dry_runs_memory_estimate_asks_the_same_check():
    """`rlctl train --dry-run` counts [N, T, V] logits for a model the learner will run on
    the full logits (RecurrentGemma's soft-cap: the name check said fused) and chunks
    for the plain Llama."""
    assert _fused(_model(TRANSFORMED["recurrent_gemma"]())) is False
    assert _fused(_model(tf.LlamaConfig(num_hidden_layers=2, **DIMS))) is True
