"""The sampler's distribution is the learner's: softmax(logits / rollout.temperature).

Training refuses rollout.top_k > 0 (rlctl/rollout/generate.py says why); eval and rollout
may still use it."""
import copy

import pytest
import torch

from rlctl.config.compose import compose
from rlctl.errors import UserError
from rlctl.models.forward import learner_forward
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.models.lora import apply_lora
from rlctl.rollout.generate import draw, generate, rollout, sampling_precision
from rlctl.types import Example
from torch.utils._python_dispatch import TorchDispatchMode

@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny", **{k: v for k, v in dict(compose([]).cfg.model).items()
                                               if k != "name"})


PROMPTS = [Example("3 1 4 1 5 ="), Example("9 2 6 ="), Example("5 3 5 8 9 7 =")]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_behaviour_logprobs_equal_the_learners_recomputation(tiny, temperature):
    """Each sampled token's log-prob recorded at generation (from the sampling loop's own
    logits) equals the learner's forward with the same temperature. Both are float32 on
    the same weights, the first through the incremental KV-cache loop, the second in one
    full forward: they differ only by rounding (measured ~1e-6; bound 1e-4)."""
    model, tok = tiny
    torch.manual_seed(0)
    b = rollout(model, tok, PROMPTS, 4, 7, temperature, 0, lambda ex, c: [0.0] * len(c),
                behaviour_logprobs=True)
    with torch.no_grad():
        f = learner_forward(model, b.input_ids, b.attention_mask, b.prompt_len, temperature)
    m = b.mask > 0
    assert m.sum() > 20
    assert torch.allclose(b.logprobs.old[m], f.logp[m], atol=1e-4, rtol=0)
    with torch.no_grad():            # the other temperature gives other log-probs: the check can fail
        g = learner_forward(model, b.input_ids, b.attention_mask, b.prompt_len, 1.0)
    assert (g.logp[m] - f.logp[m]).abs().max() > 1e-2


def test_first_tokens_are_drawn_from_the_learners_distribution(tiny):
    """8000 one-token samples of one prompt at temperature 0.7: their frequencies match
    exp(learner log-probs) of every token. Each frequency has a standard deviation of at
    most sqrt(0.25 / 8000) = 0.0056, so a 0.03 bound (over 5 sigma) fails only on a real
    mismatch; the full softmax at temperature 1 differs from it by more than that."""
    model, tok = tiny
    torch.manual_seed(1)
    n, T = 8000, 0.7
    seqs, _, P = generate(model, tok, [PROMPTS[0].prompt] * n, 1, do_sample=True, temperature=T)
    freq = torch.bincount(seqs[:, P], minlength=len(tok)).double() / n                 # [V]
    enc = tok([PROMPTS[0].prompt], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[0, -1].double()                                  # [V]
    p = torch.softmax(logits / T, -1)
    assert (freq[:p.numel()] - p).abs().max() < 0.03
    assert (torch.softmax(logits, -1) - p).abs().max() > 0.03


def test_draw_returns_the_index_whose_cumulative_interval_holds_u():
    """By hand: weights [1, 0, 1, 1] (scores 5, -inf, 5, 5) have cumulative ends [1, 1, 2, 3]
    and total 3, so u * 3 in [0, 1) -> 0, [1, 2) -> 2, [2, 3) -> 3: an end belongs to the
    interval on its right, and the zero-weight index 1 is never drawn, not even at u * 3 = 1.
    Weights [0, 1, 1, 0]: ends [0, 1, 2, 2]; u = 0 -> 1, not the zero-weight 0; u -> 1 gives
    2, not the zero-weight 3."""
    below_one = 1 - 2.0 ** -53                            # torch.rand's largest float64
    third, two_thirds = 1 / 3, 2 / 3
    assert third * 3 == 1.0 and two_thirds * 3 == 2.0    # these uniforms hit the ends exactly
    cases = [([5.0, float("-inf"), 5.0, 5.0], [0.0, 0.3333, third, 0.5, two_thirds, 0.9, below_one],
              [0, 0, 2, 2, 3, 3, 3]),
             ([float("-inf"), 0.0, 0.0, float("-inf")], [0.0, 0.25, 0.5, below_one], [1, 1, 2, 2])]
    for scores, us, want in cases:
        got = draw(torch.tensor([scores] * len(us)), torch.tensor(us, dtype=torch.float64)[:, None])
        assert got.tolist() == want, (scores, got.tolist())


def test_draw_frequencies_are_the_softmax():
    """p = [0.5, 0.3, 0.15, 0.05, 0] as scores log p. A grid of 1000 uniforms (k + 0.5) / 1000,
    each 5e-4 from any interval's end (float32 rounding moves an end by ~1e-7), lands exactly
    1000 p per index. 20000 draws from the seeded generator: each frequency within 5 binomial
    standard deviations sqrt(p (1 - p) / 20000) of p (a false failure for a random seed: under
    4 x 5.7e-7), the zero-weight index never."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    scores = p.log()
    grid = (torch.arange(1000, dtype=torch.float64)[:, None] + 0.5) / 1000              # [M, 1]
    counts = torch.bincount(draw(scores.expand(1000, -1), grid), minlength=5)
    assert counts.tolist() == [500, 300, 150, 50, 0]
    torch.manual_seed(0)
    n = 20000
    freq = torch.bincount(draw(scores.expand(n, -1)), minlength=5).double() / n        # [5]
    sd = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 5 * sd).all() and freq[4] == 0, freq


def test_training_refuses_top_k(make_trainer):
    with pytest.raises(UserError, match=r"rollout.top_k=5 is for rlctl eval and rollout only"):
        make_trainer(["rollout.top_k=5", "trainer.eval_every=0"])


def test_rlctl_train_with_top_k_is_one_line_and_exit_2(tmp_path, rlctl_app):
    # through the Typer app in-process: the same message and exit code as the console script
    out = rlctl_app("train", "rollout.top_k=5", "trainer.steps=1", "logger=none",
                    f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "rollout.top_k=5" in lines[0] and "rollout.top_k=0" in lines[0]
    assert "Traceback" not in out.stderr
    assert not any(tmp_path.glob("*-grpo-*")), "refused before a run directory is made"


class _CastCount(TorchDispatchMode):
    """Counts the dtype casts (aten._to_copy) of each tensor whose storage is in ``ptrs``."""

    def __init__(self, ptrs):
        super().__init__()
        self.ptrs, self.per_weight = ptrs, {p: 0 for p in ptrs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.per_weight[args[0].data_ptr()] += 1
        return func(*args, **(kwargs or {}))


def test_bf16_sampling_casts_frozen_weights_once_with_the_same_numbers(tiny):
    """bfloat16 sampling of a LoRA policy (frozen float32 base): the cached casts give the
    very samples and log-probs of plain per-call autocast (a cast is deterministic), and
    the base is frozen again afterwards."""
    model = apply_lora(copy.deepcopy(tiny[0]), 4, 8, 0.0, ["all-linear"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    ptrs = {p.data_ptr() for n, p in model.named_parameters() if n in frozen and p.dim() == 2}
    out, casts = [], []
    for ctx in (lambda: sampling_precision(model, "bfloat16"),
                lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        torch.manual_seed(3)
        with ctx(), _CastCount(ptrs) as count:
            out.append(generate(model, tiny[1], [p.prompt for p in PROMPTS] * 2, 6, True,
                                return_logprobs=True))
        casts.append(max(count.per_weight.values()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][3], out[1][3])
    # 6 new tokens are several forwards: per-call autocast casts each frozen matrix in every
    # one of them, the cached casts once for the whole generation
    assert casts[0] == 1 and casts[1] > 1, casts
    assert frozen and frozen == {n for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("share", [True, False])
def test_the_sampler_projects_only_last_positions_to_the_vocabulary(tiny, share):
    """The shared prompt cache's prefill projects no position to the vocabulary, the first
    sampling forward (the prefill without a shared cache) and each decode step one per row."""
    model, tok = tiny
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: seen.append(tuple(args[0].shape[:-1])))
    try:
        generate(model, tok, [PROMPTS[2].prompt] * 3, 4, True, share_prompts=share)
    finally:
        hook.remove()
    assert len(seen) >= 3 and seen[0][1] == (0 if share else 1), seen
    assert all(s[1] == 1 for s in seen[1:]), seen


def test_draw_refuses_non_finite_logits():
    """A NaN (or +inf) score makes the cumulative weights non-finite: one clear TrainingFault,
    never an index past the vocabulary."""
    from rlctl.errors import TrainingFault
    for bad in (float("nan"), float("inf")):
        with pytest.raises(TrainingFault, match="non-finite logits"):
            draw(torch.tensor([[0.0, 1.0, 2.0], [0.0, bad, 1.0]]))
