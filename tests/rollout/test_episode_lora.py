"""LoRA (model.lora.enabled=true) with a task played as episodes: 2 steps of a Trainer built
as `rlctl train` builds it, with a KL term (algo.kl.coef) whose reference is the same
model with its adapter disabled. LoRA B starts at 0, so at step 1 the policy is the base
and KL(pi || ref) is exactly 0; the base weights never move, the adapter does; afterwards
the reference's log-probs of an episode batch are those of a fresh base model built from
the same config (same seed) without LoRA, and the policy's are not."""
import pytest
import torch
from omegaconf import OmegaConf

from episode_runs import build_trainer, env_file, run_args
from rlctl.config.compose import compose
from rlctl.models.forward import learner_forward
from rlctl.train.build import model_from_config

LORA = ["model.lora.enabled=true", "model.lora.r=4", "algo.kl.coef=0.05", "trainer.lr=1e-2"]


def test_a_lora_run_on_episodes_trains_the_adapter_against_the_disabled_base(tmp_path):
    spec = env_file(tmp_path)
    tr = build_trainer(run_args(spec) + LORA)
    try:   # the episodes' model-token budget: 3 turns x 3 tokens (under max_tokens=20)
        assert tr.update_settings.algo.norm_len == 3 * 3
        named = dict(tr.policy.named_parameters())
        base = {k: p.detach().clone() for k, p in named.items() if "lora_" not in k}
        adapter = {k: p.detach().clone() for k, p in named.items() if "lora_" in k}
        assert adapter and all(not named[k].requires_grad for k in base)
        steps = [tr.step(i) for i in (1, 2)]
        # B = 0: pi is the base at step 1. k1 takes the sampler's behaviour log-probs against
        # the reference's forward: float32 rounding of log-probs < 20 (< 1e-5 per token) is
        # all that differs, so k3 ~ d^2 / 2 < 5e-11 (measured 1.6e-14, then 1.1e-5 at step 2)
        assert abs(steps[0]["kl/k1"]) < 1e-5 and steps[0]["kl/k3"] < 1e-10
        assert steps[1]["kl/k3"] > 1e-8                                     # the adapter moved
        assert all(torch.equal(named[k], v) for k, v in base.items())
        assert any(not torch.equal(named[k], v) for k, v in adapter.items())
        assert all(1 <= s["episode/turns_mean"] <= 3 for s in steps)
        batch = tr.source.sample(2)
        cfg = compose(run_args(spec)).cfg
        OmegaConf.resolve(cfg)
        fresh, *_ = model_from_config(cfg)                                  # no LoRA
        args = (batch.input_ids, batch.attention_mask, batch.prompt_len)
        with torch.no_grad():
            want = learner_forward(fresh.eval(), *args).logp
            ref = learner_forward(tr.ref_model, *args).logp
            pi = learner_forward(tr.policy.eval(), *args).logp
        m = batch.mask > 0
        # the same float32 weights and ops: equal up to float32 rounding of log-probs < 20
        assert (ref - want)[m].abs().max() < 1e-5
        assert (pi - want)[m].abs().max() > 1e-4                           # the check can fail
    finally:
        tr.close()
