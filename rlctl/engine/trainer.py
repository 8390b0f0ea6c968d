"""The training loop: rollout -> score -> advantages -> minibatch updates -> log.

The loop asks registries for the advantage estimator and the policy loss; it never
branches on an algorithm's name. Forward passes are made only where the configuration
needs them: old log-probs when a rollout feeds several optimizer steps, KL is shaped
into the reward or the coefficient is adaptive, or a critic needs rollout-time values;
reference log-probs only when the KL coefficient is non-zero (and only then is a
reference model kept in memory). The old policy (pi_old: the weights that generated
this rollout) and the reference policy (pi_ref: the weights at the start of the run)
are distinct: ``old_logprobs`` come from ``self.model`` before the update,
``ref_logprobs`` from the frozen ``self.ref_model``.
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch
from omegaconf import DictConfig

from rlctl.core import AdaptiveKLController, FixedKLController, get_policy_loss, masked_mean
from rlctl.engine.advantage import AdvantageSettings, compute_advantages
from rlctl.engine.evaluate import evaluate
from rlctl.engine.policy import learner_forward
from rlctl.engine.stats import POLICY_KEYS, rollout_metrics, to_floats
from rlctl.engine.update import UpdateSettings, UpdateState, update_policy
from rlctl.rollout.collect import collect
from rlctl.rollout.generate import rollout
from rlctl.tasks.base import Task
from rlctl.types import Example, RolloutBatch


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens_per_s: float
    eval_start: Dict[str, float] = field(default_factory=dict)
    eval_end: Dict[str, float] = field(default_factory=dict)
    last_metrics: Dict[str, float] = field(default_factory=dict)


class SafeScorer:
    """Wraps a task's reward: an exception or a non-finite value scores 0 and is counted."""

    def __init__(self, task: Task):
        self.task, self.errors = task, 0

    def __call__(self, example: Example, completion: str) -> float:
        try:
            value = float(self.task.reward(example, completion))
        except Exception:  # noqa: BLE001 - a reward function must never crash the run
            value = float("nan")
        if value != value or value in (float("inf"), float("-inf")):
            self.errors += 1
            return 0.0
        return value


def frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class Trainer:
    """``model``: the policy, or a PolicyValueModel (shared critic); ``critic``: a separate
    value model or None."""

    def __init__(self, cfg: DictConfig, model, tokenizer, task: Task, sink, critic=None,
                 ref_model=None):
        self.cfg, self.model, self.tokenizer, self.task, self.sink = cfg, model, tokenizer, task, sink
        self.critic = critic
        algo, tr = cfg.algo, cfg.trainer
        self.settings = UpdateSettings(
            policy_loss=get_policy_loss(algo.policy_loss), clip_low=algo.clip_eps,
            clip_high=algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps,
            clip_ratio_c=algo.clip_ratio_c, agg_mode=algo.loss_agg_mode, norm_len=algo.norm_len,
            epochs=algo.epochs, minibatches=algo.minibatches, kl_estimator=algo.kl.estimator,
            kl_in_loss=algo.kl.placement == "in_loss", max_grad_norm=tr.max_grad_norm,
            temperature=cfg.rollout.temperature, micro_batch_size=tr.micro_batch_size,
            vf_coef=algo.vf_coef, value_clip=algo.value_clip)
        self.adv_settings = AdvantageSettings(
            estimator=algo.advantage, std_eps=algo.std_eps, baseline=algo.baseline,
            gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten_advantages,
            kl_in_reward=algo.kl.placement == "in_reward", kl_estimator=algo.kl.estimator,
            overlong_buffer=algo.overlong_buffer, overlong_penalty=algo.overlong_penalty,
            max_new_tokens=cfg.rollout.max_new_tokens)
        self.kl_ctl = (AdaptiveKLController(algo.kl.coef, algo.kl.target, algo.kl.horizon)
                       if algo.kl.target is not None else FixedKLController(algo.kl.coef))
        self.ref_model = ref_model if ref_model is not None else (
            frozen_copy(getattr(model, "policy", model)) if algo.kl.coef > 0 else None)
        params = list(model.parameters()) + (list(critic.parameters()) if critic is not None else [])
        policy_ids = {id(p) for p in getattr(model, "policy", model).parameters()}
        self.critic_only = frozenset(id(p) for p in params if id(p) not in policy_ids)
        self.optimizer = torch.optim.AdamW(params, lr=tr.lr, betas=tuple(tr.betas),
                                           weight_decay=tr.weight_decay)
        warm = max(int(tr.warmup_steps), 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / warm) if warm else 1.0)
        self.scorer = SafeScorer(task)
        self.train_examples = task.train_examples()
        self.eval_examples = task.eval_examples()
        self.sampler = random.Random(cfg.seed)

    # ---- rollout side -------------------------------------------------------------
    def _sample(self, num_groups: int) -> RolloutBatch:
        examples = [self.train_examples[self.sampler.randrange(len(self.train_examples))]
                    for _ in range(num_groups)]
        ro = self.cfg.rollout
        return rollout(self.model, self.tokenizer, examples, self.cfg.algo.group_size,
                       ro.max_new_tokens, ro.temperature, ro.top_k, self.scorer)

    def _needs_old_forward(self) -> bool:
        s, a = self.settings, self.adv_settings
        return (s.epochs * s.minibatches > 1 or self.critic_only != frozenset()
                or (a.kl_in_reward and self.kl_ctl.coef > 0)
                or isinstance(self.kl_ctl, AdaptiveKLController))

    @torch.no_grad()
    def _prepare(self, batch: RolloutBatch) -> None:
        """Old/reference log-probs and values where needed, then advantages and returns."""
        args = (batch.input_ids, batch.attention_mask, batch.prompt_len, self.settings.temperature)
        if self._needs_old_forward():
            self.model.eval()
            f = learner_forward(self.model, *args, critic=self.critic)
            batch.old_logprobs, batch.old_values = f.logp, f.values
        if self.ref_model is not None:
            batch.ref_logprobs = learner_forward(self.ref_model, *args).logp
        batch.advantages, batch.returns = compute_advantages(
            batch, self.adv_settings, self.kl_ctl.coef, batch.old_values)

    def _evaluate(self) -> Dict[str, float]:
        return evaluate(self.model, self.tokenizer, self.task, self.eval_examples,
                        self.cfg.rollout.max_new_tokens)

    # ---- the loop -------------------------------------------------------------------
    def step(self, step: int) -> Dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.model.eval()
        batch, kept = collect(self._sample, cfg.trainer.prompts_per_step, cfg.algo.dynamic_sampling,
                              cfg.algo.max_sampling_rounds, self.tokenizer.pad_token_id)
        self._prepare(batch)
        t1 = time.perf_counter()
        state = UpdateState(kl_coef=self.kl_ctl.coef, critic_only=self.critic_only,
                            policy_frozen=step <= cfg.algo.critic_warmup_steps)
        policy = update_policy(self.model, self.optimizer, self.scheduler, batch, self.settings,
                               state, self.critic)
        t2 = time.perf_counter()
        metrics = rollout_metrics(batch)
        metrics.update({POLICY_KEYS.get(k, k if "/" in k else f"policy/{k}"): v for k, v in policy.items()})
        if batch.returns is not None:
            metrics["return/mean"] = masked_mean(batch.returns, batch.mask)
        if batch.ref_logprobs is not None and batch.old_logprobs is not None:
            seq_kl = ((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum(-1).mean()
            metrics["kl/seq_k1"] = seq_kl
        values = to_floats(metrics)
        tokens = values["length/mean"] * batch.num_sequences
        values.update({"kl/coef": self.kl_ctl.coef, "dapo/kept_groups_frac": kept,
                       "optim/lr": self.scheduler.get_last_lr()[0],
                       "reward/errors": float(self.scorer.errors),
                       "time/rollout_s": t1 - t0, "time/update_s": t2 - t1,
                       "perf/tokens_per_s": tokens / max(t2 - t0, 1e-9)})
        if "kl/seq_k1" in values:
            self.kl_ctl.update(values["kl/seq_k1"], 1)
        return values

    def train(self, on_step=None) -> TrainResult:
        tr = self.cfg.trainer
        t_start, tokens = time.perf_counter(), 0.0
        result = TrainResult(steps=tr.steps, seconds=0.0, tokens_per_s=0.0)
        if tr.eval_every > 0:
            result.eval_start = self._evaluate()
            self.sink.log(result.eval_start, step=0)
        for step in range(1, tr.steps + 1):
            values = self.step(step)
            tokens += values["perf/tokens_per_s"] * (values["time/rollout_s"] + values["time/update_s"])
            if tr.eval_every > 0 and (step % tr.eval_every == 0 or step == tr.steps):
                values.update(self._evaluate())
            values["time/elapsed_s"] = time.perf_counter() - t_start
            if step % tr.log_every == 0 or step == tr.steps:
                self.sink.log(values, step=step)
            result.last_metrics = values
            if on_step is not None:
                on_step(step, values)
        result.seconds = time.perf_counter() - t_start
        result.tokens_per_s = tokens / max(result.seconds, 1e-9)
        if tr.eval_every > 0:
            result.eval_end = {k: v for k, v in result.last_metrics.items() if k.startswith("eval/")} \
                or self._evaluate()
        return result
