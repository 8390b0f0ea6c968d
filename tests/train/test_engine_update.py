"""The learner's update and advantage stage on the real tiny model."""
import copy

import pytest
import torch
from gloo_ranks import run_two_ranks

from rlctl.dist.backends import TorchBackend
from learner_kit import settings
from rlctl.config.compose import compose
from rlctl.core import get_policy_loss
from rlctl.train.trainer import compute_advantages
from rlctl.models.forward import learner_forward
from rlctl.train.update import UpdateSettings, UpdateState, accumulate_gradients
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.rollout.source import keep_informative_groups
from rlctl.types import LogProbs, RolloutBatch

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny", **{k: v for k, v in dict(compose([]).cfg.model).items()
                                               if k != "name"})


def _batch(tokenizer, n=6, t=5, seed=0) -> RolloutBatch:
    """A ragged batch: prompts of the task format, completions of lengths 0..t."""
    g = torch.Generator().manual_seed(seed)
    enc = tokenizer(["3 1 4 1 5 ="] * n, return_tensors="pt")
    digits = torch.tensor(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    comp = digits[torch.randint(0, 10, (n, t), generator=g)]                    # [N, T]
    lengths = torch.tensor([t, 3, 1, 0, 4, 2][:n])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()               # [N, T]
    ids = torch.cat([enc["input_ids"], comp], 1)
    attn = torch.cat([enc["attention_mask"], mask.long()], 1)
    b = RolloutBatch(input_ids=ids, attention_mask=attn, mask=mask, truncated=lengths == t,
                     rewards=torch.rand(n, generator=g), group_ids=torch.arange(n) // 3,
                     prompt_len=enc["input_ids"].shape[1], group_size=3,
                     prompts=["p"] * n, completions=["c"] * n)
    b.advantages = torch.randn(n, 1, generator=g).double() * mask.double()
    return b


def _settings(mode, micro):
    return settings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                          agg_mode=mode, norm_len=7, epochs=1, minibatches=1, kl_estimator="k3",
                          kl_in_loss=True, temperature=1.0, micro_batch_size=micro)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_accumulation_matches_one_batch(tiny, mode):
    """Invariance: every aggregation mode, k micro-batches == one batch, to 1e-6 (float64),
    with a KL-in-loss term too (reference = a perturbed copy)."""
    model, tok = tiny
    model = copy.deepcopy(model).double()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = _batch(tok)
    with torch.no_grad():
        batch.logprobs = LogProbs(ref=learner_forward(ref, batch.input_ids, batch.attention_mask,
                                                      batch.prompt_len).logp)
    grads = []
    for micro in (0, 1, 4):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, TorchBackend(), batch, _settings(mode, micro), UpdateState(kl_coef=0.1))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], atol=1e-6, rtol=1e-6)


def test_in_reward_shaping_then_gae_gives_the_hand_worked_example():
    """Worked by hand: final reward 1, logp [-1,-.5,-.2], ref [-1.2,-.5,-.4], beta .05, values
    [.5,.6,.8], gamma 1, lam .95. Shaped rewards [-.01, 0, .99]; by hand, deltas
    [.09, .2, .19] and advantages [.09 + .95 * .3805, .2 + .95 * .19, .19]."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])                # one padded position
    b = RolloutBatch(input_ids=torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 5),
                     mask=mask, truncated=torch.tensor([False]), rewards=torch.tensor([1.0]),
                     group_ids=torch.tensor([0]), prompt_len=1, group_size=1, prompts=["p"],
                     completions=["c"])
    b.logprobs = LogProbs(old=torch.tensor([[-1.0, -0.5, -0.2, 0.0]]),
                          ref=torch.tensor([[-1.2, -0.5, -0.4, 0.0]]))
    s = settings(estimator="gae", std_eps=1e-6, baseline="none", gamma=1.0, lam=0.95,
                          whiten=False, kl_in_reward=True, kl_estimator="k1", overlong_buffer=0,
                          overlong_penalty=1.0, max_new_tokens=4)
    adv, ret = compute_advantages(b, s, kl_coef=0.05, values=torch.tensor([[0.5, 0.6, 0.8, 0.0]]))
    expected = torch.tensor([[0.09 + 0.95 * 0.3805, 0.2 + 0.95 * 0.19, 0.19, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret[:, :3], expected[:, :3] + torch.tensor([[0.5, 0.6, 0.8]]))


def test_outcome_estimator_gets_the_shaped_return():
    """With KL in the reward, an outcome estimator sees R - beta * sum_t k1_t per sequence."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    b = RolloutBatch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                     mask=mask, truncated=torch.tensor([False, False]), rewards=torch.tensor([1.0, 0.0]),
                     group_ids=torch.tensor([0, 0]), prompt_len=1, group_size=2, prompts=["p"] * 2,
                     completions=["c"] * 2)
    b.logprobs = LogProbs(old=torch.tensor([[-1.0, -1.0], [-2.0, 0.0]]),
                          ref=torch.tensor([[-2.0, -1.0], [-1.0, 0.0]]))   # k1 sums: 1.0 and -1.0
    s = settings(estimator="reinforce", std_eps=0.0, baseline="none", gamma=1.0, lam=1.0,
                          whiten=False, kl_in_reward=True, kl_estimator="k1", overlong_buffer=0,
                          overlong_penalty=1.0, max_new_tokens=2)
    adv, ret = compute_advantages(b, s, kl_coef=0.5, values=None)
    assert ret is None
    # returns: 1 - 0.5 * 1 = 0.5 and 0 - 0.5 * (-1) = 0.5, broadcast over counted tokens
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [0.5, 0.0]]))


def test_dynamic_sampling_keeps_informative_groups_and_concat_pads(tiny):
    _, tok = tiny
    b = _batch(tok)                      # 2 groups of 3
    b.rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    kept = keep_informative_groups(b)
    assert kept.num_sequences == 3 and kept.rewards.tolist() == [0.0, 1.0, 0.5]
    assert kept.group_ids.tolist() == [0, 0, 0]
    short = b.select(torch.arange(3))
    short.mask, short.input_ids = short.mask[:, :2], short.input_ids[:, :-3]
    short.attention_mask = short.attention_mask[:, :-3]
    short.advantages = short.advantages[:, :2]
    both = RolloutBatch.concat([short, kept], tok.pad_token_id)
    assert both.mask.shape == (6, 5) and both.mask[:3, 2:].sum() == 0
    assert both.input_ids.shape == (6, b.prompt_len + 5)
    assert both.group_ids.tolist() == [0, 0, 0, 1, 1, 1]


def test_kl_side_by_side_metrics_are_token_means_of_k1_and_k3(tiny):
    """kl/k1 and kl/k3 are logged whatever the training estimator (here k2 in the loss):
    masked token means over the batch of log pi - log ref and of exp(d) - d - 1,
    d = log ref - log pi, recomputed here from an independent forward."""
    model, tok = tiny
    batch = _batch(tok)
    torch.manual_seed(3)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
        batch.logprobs = LogProbs(ref=learner_forward(ref, batch.input_ids, batch.attention_mask,
                                                      batch.prompt_len).logp)
        logp = learner_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_len).logp
    s = _settings("token-mean", 0)
    s.kl_estimator, s.kl_in_loss = "k2", True
    metrics = accumulate_gradients(copy.deepcopy(model), TorchBackend(), batch, s, UpdateState(kl_coef=0.1))
    m = batch.mask.double()
    d = (batch.logprobs.ref - logp).double()                          # [N, T]
    k1 = float((-d * m).sum() / m.sum())
    k3 = float(((d.exp() - d - 1) * m).sum() / m.sum())
    assert metrics["kl/k1"].item() == pytest.approx(k1, rel=1e-4, abs=1e-7)
    assert metrics["kl/k3"].item() == pytest.approx(k3, rel=1e-4, abs=1e-7)
    assert k3 > 1e-5 and not metrics["kl/k1"].requires_grad


def test_adaptive_kl_moves_by_the_global_sequence_count(make_trainer):
    """At step 1 the policy is the reference, so kl/seq_k1 = 0 and the error -1 clips to
    -0.2: beta <- beta * (1 - 0.2 * n / horizon) with n = 4 prompts x 4 samples = 16
    sequences (the controller counts sequences, not updates)."""
    tr = make_trainer(["algo=grpo", "algo.kl.coef=0.1", "algo.kl.target=6", "algo.kl.horizon=1000",
                       "trainer.prompts_per_step=4", "algo.group_size=4", "trainer.eval_every=0"])
    values = tr.step(1)
    assert values["kl/seq_k1"] == 0.0 and "perf/step_sequences" not in values
    assert tr.kl_ctl.coef == pytest.approx(0.1 * (1 - 0.2 * 16 / 1000), rel=1e-12)


@pytest.mark.parametrize("placement,kind", [("in_reward", "k1"), ("in_loss", "k3")])
def test_kl_estimator_and_norm_len_defaults_resolve_once(make_trainer, placement, kind):
    """algo.kl.estimator null -> k1 in the reward, k3 in the loss; norm_len -> the
    generation limit (not the step's generated length), for every algorithm's preset."""
    tr = make_trainer(["algo=rloo", f"algo.kl.placement={placement}", "algo.kl.coef=0.05",
                       "algo.loss_agg_mode=seq-mean-token-sum-norm", "rollout.max_new_tokens=6"])
    assert compose(["algo=rloo"]).cfg.algo.kl.estimator is None        # null in the config
    assert tr.update_settings.kl_estimator == kind
    assert tr.update_settings.algo.norm_len == 6
    assert compose(["algo=ppo"]).cfg.algo.kl.estimator is None          # PPO: k1 in the reward
    assert compose(["algo=ppo"]).cfg.algo.kl.placement == "in_reward"


@pytest.mark.parametrize("turns, tokens, expected", [(4, 200, 4 * 9), (4, 20, 20), (1, 200, 9)])
def test_norm_len_default_of_episodes_is_their_model_token_budget(turns, tokens, expected):
    """Episodes: max_turns x max_new_tokens model tokens at most, and at most the episode's
    max_tokens (turns and observations); a given norm_len is kept."""
    over = ["rollout.max_new_tokens=9", f"rollout.episode.max_turns={turns}",
            f"rollout.episode.max_tokens={tokens}", "algo=dr_grpo"]
    assert UpdateSettings.from_config(compose(over).cfg, True, episodic=True).algo.norm_len == expected
    assert UpdateSettings.from_config(compose(over).cfg, True).algo.norm_len == 9
    assert UpdateSettings.from_config(compose(over + ["algo.norm_len=5"]).cfg, True,
                                      episodic=True).algo.norm_len == 5


def test_norm_len_default_makes_the_loss_independent_of_the_step_width(tiny):
    """seq-mean-token-sum-norm with the configured norm_len: padding the batch to a wider
    T (a step whose longest completion is longer) leaves the loss unchanged; with
    norm_len None (T) it would change by the width ratio."""
    model, tok = tiny
    norm_len = UpdateSettings.from_config(compose(["rollout.max_new_tokens=9"]).cfg, True).algo.norm_len
    assert norm_len == 9
    batch = _batch(tok)
    wide = copy.copy(batch)
    pad = torch.full((batch.num_sequences, 3), tok.pad_token_id)
    wide.input_ids = torch.cat([batch.input_ids, pad], 1)
    wide.attention_mask = torch.cat([batch.attention_mask, torch.zeros_like(pad)], 1)
    wide.mask = torch.cat([batch.mask, torch.zeros(batch.num_sequences, 3)], 1)
    wide.advantages = torch.cat([batch.advantages, torch.zeros(batch.num_sequences, 3).double()], 1)
    losses = {}
    for name, b in (("narrow", batch), ("wide", wide)):
        s = _settings("seq-mean-token-sum-norm", 0)
        s.algo.norm_len, s.trim_padding = norm_len, False
        losses[name] = accumulate_gradients(copy.deepcopy(model), TorchBackend(), b, s, UpdateState())["policy/loss"].item()
    assert losses["wide"] == pytest.approx(losses["narrow"], rel=1e-5)
    assert abs(losses["narrow"]) > 1e-4


# ---- policy/loss with W data-parallel ranks: the loss of the whole global batch --------

def _dp_loss_worker(out_dir: str) -> None:
    """One rank (run in a subprocess by the test below): its share of dp_worker's
    synthetic batch, one update, metrics reduced as the trainer reduces them."""
    import json
    import os

    from dp_worker import B, G, synthetic_batch
    from rlctl.dist.backends import build_backend
    from rlctl.train.metrics import reduce_metrics
    from rlctl.train.update import update_policy

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = build_backend("torch", "cpu")
    model, tok = load_model_and_tokenizer("tiny", **{k: v for k, v in dict(compose([]).cfg.model).items()
                                                     if k != "name"})
    per = B // world
    batch = synthetic_batch(tok).select(torch.arange(rank * per * G, (rank + 1) * per * G))
    engine = backend.prepare(model, None, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0,
                             warmup_steps=0, max_grad_norm=1.0)
    start = copy.deepcopy(backend.unwrap().state_dict())
    out = {}
    for mode in ("token-mean", "seq-mean-token-sum"):
        backend.unwrap().load_state_dict(start)      # the loss is taken before the step
        s = _settings(mode, 0)
        s.kl_in_loss, s.share_prompts = False, False
        m = update_policy(engine, backend, batch, s, UpdateState())
        m["perf/step_sequences"] = torch.tensor(float(batch.num_sequences))
        out[mode] = reduce_metrics(m, backend)
    if rank == 0:
        with open(os.path.join(out_dir, f"w{world}.json"), "w") as f:
            json.dump(out, f)
    backend.close()


def test_logged_policy_loss_of_two_ranks_is_the_global_batch_loss(tmp_path, monkeypatch):
    """2 gloo ranks, each with half of the groups, log the same policy/loss as one process
    on the whole batch (before the fix each rank's share was averaged: half the value).
    float32, same weights, only the summation order differs: rel 1e-5 is ample. The one
    process is this one (world size 1 forms no process group); the 2 ranks are subprocesses."""
    import json
    from pathlib import Path

    here = Path(__file__).resolve().parent
    with monkeypatch.context() as mp:
        mp.syspath_prepend(str(here.parent / "dist"))          # dp_worker
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            mp.setenv(key, value)
        _dp_loss_worker(str(tmp_path))
    run_two_ranks("test_engine_update", f"_dp_loss_worker({str(tmp_path)!r})", tmp_path, 300,
                  paths=[here.parent / "dist"])
    one, two = (json.loads((tmp_path / f"w{w}.json").read_text()) for w in (1, 2))
    for mode in one:
        assert abs(one[mode]["policy/loss"]) > 1e-3
        assert two[mode]["policy/loss"] == pytest.approx(one[mode]["policy/loss"], rel=1e-5)
        assert one[mode]["perf/step_sequences"] == two[mode]["perf/step_sequences"] == 12
