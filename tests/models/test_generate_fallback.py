"""The ``generate`` fallback (ZeRO-3 across ranks: ``synced_gpus``; models whose forward
takes no cache keyword; greedy eval) ignores the checkpoint's own sampling settings.

A checkpoint's generation_config.json may set a repetition penalty, top-k/top-p, min-p,
banned words...; HF's ``generate`` applies them as logits processors unless told
otherwise, so tokens would be drawn from a distribution other than the
softmax(logits / T) the behaviour and learner log-probs use (a biased ratio). The
processors HF builds are read off its own ``_get_logits_processor`` during the call."""
import pytest
import torch

from rlctl.config.compose import compose
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.rollout.generate import generate

# every setting that adds a processor when the call leaves it unset (written by hand)
CHECKPOINT = dict(repetition_penalty=1.7, top_k=3, top_p=0.5, min_p=0.1, typical_p=0.9,
                  no_repeat_ngram_size=2, bad_words_ids=[[5]], suppress_tokens=[7],
                  epsilon_cutoff=0.01, renormalize_logits=True, do_sample=True, temperature=0.3)


@pytest.fixture
def tiny():
    model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(compose([]).cfg.model).items()
                                                     if k != "name"})
    for k, v in CHECKPOINT.items():
        setattr(model.generation_config, k, v)
    return model, tok


def _processors(model, tok, **kw):
    seen = []
    build = model._get_logits_processor

    def spy(*args, **kwargs):
        seen.append(build(*args, **kwargs))
        return seen[-1]

    model._get_logits_processor = spy
    torch.manual_seed(0)
    out = generate(model, tok, ["3 1 4 ="] * 2, 4, synced_gpus=False, **kw)   # any kwarg: the fallback
    del model._get_logits_processor
    assert len(seen) == 1
    return [type(p).__name__ for p in seen[0]], out


@pytest.mark.parametrize("temperature, expected", [(0.7, ["TemperatureLogitsWarper"]), (1.0, [])])
def test_sampling_uses_only_the_temperature(tiny, temperature, expected):
    model, tok = tiny
    names, (seqs, _, plen, logp) = _processors(model, tok, do_sample=True, temperature=temperature,
                                               return_logprobs=True)
    assert names == expected
    assert logp.shape == seqs[:, plen:].shape and bool((logp <= 0).all())
    assert model.generation_config.repetition_penalty == 1.7     # the checkpoint's config is back


def test_greedy_uses_no_processor(tiny):
    model, tok = tiny
    names, _ = _processors(model, tok, do_sample=False)
    assert names == []
    assert model.generation_config.top_k == 3 and model.generation_config.bad_words_ids == [[5]]
