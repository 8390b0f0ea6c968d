"""The loop: old vs reference policy, and every algorithm end to end through the CLI."""
import copy

import pytest
import torch

from rlctl.models.forward import learner_forward
from rlctl.sinks.jsonl import read_jsonl

ALGOS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce", "rloo", "ppo"]


def test_old_and_reference_policies_are_distinct(make_trainer):
    """After one update, the next rollout's old log-probs must come from the *current*
    weights and its reference log-probs from the *initial* weights. Swapping either
    (or refreshing the reference) fails this test."""
    tr = make_trainer(["algo.kl.coef=0.1", "algo.epochs=2", "trainer.lr=1e-3",
                   "trainer.prompts_per_step=4", "algo.group_size=4", "trainer.eval_every=0"])
    initial = copy.deepcopy(tr.model)
    tr.step(1)
    current = copy.deepcopy(tr.model)
    seen = {}
    prepare = tr._prepare

    def spy(batch, prompts):
        seen["batch"] = prepare(batch, prompts)
        return seen["batch"]
    tr._prepare = spy
    tr.step(2)
    b = seen["batch"]
    args = (b.input_ids, b.attention_mask, b.prompt_len)
    with torch.no_grad():
        want_old = learner_forward(current.eval(), *args).logp
        want_ref = learner_forward(initial.eval(), *args).logp
    m = b.mask.bool()
    assert (want_old[m] - want_ref[m]).abs().max() > 1e-3          # the policy did move
    torch.testing.assert_close(b.logprobs.old[m], want_old[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(b.logprobs.ref[m], want_ref[m], atol=1e-5, rtol=0)


def test_single_pass_makes_no_old_or_reference_forward(make_trainer):
    tr = make_trainer(["trainer.prompts_per_step=2", "algo.group_size=2", "trainer.eval_every=0"])
    assert tr.ref_model is None
    seen = {}
    prepare = tr._prepare
    tr._prepare = lambda b, prompts: seen.setdefault("b", prepare(b, prompts))
    tr.step(1)
    assert seen["b"].logprobs.old is None and seen["b"].logprobs.ref is None


@pytest.mark.parametrize("kl", [[], ["algo.kl.coef=0.5", "algo.kl.placement=in_loss", "algo.kl.estimator=k1"]])
def test_critic_warmup_moves_only_the_value_head(make_trainer, kl):
    """Also with a KL term in the loss: during warm-up it must not move the policy (k1,
    whose gradient is not zero at policy == reference, unlike k3's)."""
    from rlctl.models.value import PolicyValueModel
    tr = make_trainer(["algo=ppo", "algo.critic_warmup_steps=1", "trainer.prompts_per_step=2",
                       "algo.group_size=2", "trainer.eval_every=0", *kl],
                      wrap=lambda model: PolicyValueModel(model, init_std=0.05))
    before = copy.deepcopy(tr.model)
    tr.step(1)
    moved = {n for (n, p), q in zip(tr.model.named_parameters(), before.parameters())
             if not torch.equal(p, q)}
    assert moved and all(n.startswith("value_head") for n in moved), moved


@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_runs_through_the_cli(algo, tmp_path, rlctl_app):
    """`rlctl train algo=...` through the Typer app in-process (the console script itself
    is run by tests/test_train_e2e.py)."""
    out = rlctl_app("train", f"algo={algo}", "trainer.steps=3", "trainer.eval_every=3",
                    "task.num_eval=16", "trainer.prompts_per_step=4", "logger=jsonl",
                    "run.save_model=false", f"run.output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert all(v is not None for v in r.values()), r
        assert r["policy/entropy"] > 0 and r["reward/mean"] >= 0
        if algo == "ppo":
            assert {"value/loss", "value/explained_var", "value/clip_frac", "value/mean",
                    "value/return_mean"} <= set(r)
        if algo == "dapo":
            assert 0 < r["rollout/kept_groups_frac"] <= 1


def test_critic_warmup_ends_each_micro_batch_graph_with_it(make_trainer, monkeypatch):
    """In warm-up nothing backpropagates through the policy's log-probs, nor through its
    entropy (which an entropy bonus puts in the graph): each micro-batch's graph, with the
    fused head's kept logits, must be gone before the next micro-batch's forward starts.
    Counted by weak references to the fused head's autograd contexts."""
    import weakref

    import rlctl.train.update as update
    from rlctl.core import logprobs
    from rlctl.models.value import PolicyValueModel

    contexts, alive = [], []
    head_forward = logprobs._ChunkedLinearLogprobs.forward

    def recorded(ctx, *args):
        contexts.append(weakref.ref(ctx))
        return head_forward(ctx, *args)

    forward = update.learner_forward

    def counted(*args, **kwargs):
        alive.append(sum(ref() is not None for ref in contexts))
        return forward(*args, **kwargs)

    monkeypatch.setattr(logprobs._ChunkedLinearLogprobs, "forward", staticmethod(recorded))
    monkeypatch.setattr(update, "learner_forward", counted)
    tr = make_trainer(["algo=ppo", "algo.critic_warmup_steps=1", "algo.entropy_coef=0.01",
                       "trainer.prompts_per_step=2", "algo.group_size=2",
                       "trainer.micro_batch_size=1", "trainer.eval_every=0"],
                      wrap=lambda model: PolicyValueModel(model, init_std=0.05))
    tr.step(1)
    # 4 rows, a micro-batch each, in each of PPO's epochs; the fused head ran
    assert len(alive) >= 4 and len(alive) % 4 == 0 and contexts, (alive, len(contexts))
    assert alive == [0] * len(alive)
