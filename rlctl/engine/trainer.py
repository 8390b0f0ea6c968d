"""The training loop: rollout -> score -> advantages -> minibatch updates -> log.

The loop asks registries for the advantage estimator and the policy loss; it never
branches on an algorithm's name. Old log-probs are computed only when a rollout is
used for more than one optimizer step, reference log-probs only when the KL
coefficient is non-zero (and only then is a reference model kept in memory).
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from omegaconf import DictConfig

from rlctl.core.advantages import broadcast_to_tokens, get_advantage_estimator
from rlctl.core.losses import get_policy_loss
from rlctl.engine.evaluate import evaluate
from rlctl.engine.policy import policy_logprobs
from rlctl.engine.stats import POLICY_KEYS, rollout_metrics, to_floats
from rlctl.engine.update import UpdateSettings, update_policy
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


class Trainer:
    def __init__(self, cfg: DictConfig, model, tokenizer, task: Task, sink):
        self.cfg, self.model, self.tokenizer, self.task, self.sink = cfg, model, tokenizer, task, sink
        algo, tr = cfg.algo, cfg.trainer
        self.advantage_fn = get_advantage_estimator(algo.advantage)
        self.settings = UpdateSettings(
            policy_loss=get_policy_loss(algo.policy_loss), clip_low=algo.clip_eps,
            clip_high=algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps,
            agg_mode=algo.loss_agg_mode, norm_len=algo.norm_len, epochs=algo.epochs,
            minibatches=algo.minibatches, kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator,
            max_grad_norm=tr.max_grad_norm, temperature=cfg.rollout.temperature)
        self.ref_model = self._frozen_copy(model) if algo.kl.coef > 0 else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tuple(tr.betas),
                                           weight_decay=tr.weight_decay)
        warm = max(int(tr.warmup_steps), 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / warm) if warm else 1.0)
        self.scorer = SafeScorer(task)
        self.train_examples = task.train_examples()
        self.eval_examples = task.eval_examples()
        self.sampler = random.Random(cfg.seed)

    @staticmethod
    def _frozen_copy(model):
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _sample_prompts(self) -> List[Example]:
        return [self.train_examples[self.sampler.randrange(len(self.train_examples))]
                for _ in range(self.cfg.trainer.prompts_per_step)]

    def _evaluate(self) -> Dict[str, float]:
        return evaluate(self.model, self.tokenizer, self.task, self.eval_examples,
                        self.cfg.rollout.max_new_tokens)

    @torch.no_grad()
    def _prepare(self, batch: RolloutBatch) -> None:
        """Advantages, plus old/reference log-probs where the configuration needs them."""
        s, G = self.settings, self.cfg.algo.group_size
        adv = self.advantage_fn(batch.rewards.view(-1, G), self.cfg.algo.std_eps)   # [B, G]
        batch.advantages = broadcast_to_tokens(adv, batch.mask)                     # [N, T]
        args = (batch.input_ids, batch.attention_mask, batch.prompt_len, s.temperature)
        if s.epochs * s.minibatches > 1:
            self.model.eval()
            batch.old_logprobs, _ = policy_logprobs(self.model, *args)
        if self.ref_model is not None:
            batch.ref_logprobs, _ = policy_logprobs(self.ref_model, *args)

    def train(self, on_step=None) -> TrainResult:
        cfg, tr = self.cfg, self.cfg.trainer
        t_start, tokens = time.perf_counter(), 0.0
        result = TrainResult(steps=tr.steps, seconds=0.0, tokens_per_s=0.0)
        if tr.eval_every > 0:
            result.eval_start = self._evaluate()
            self.sink.log(result.eval_start, step=0)
        for step in range(1, tr.steps + 1):
            t0 = time.perf_counter()
            self.model.eval()
            batch = rollout(self.model, self.tokenizer, self._sample_prompts(), cfg.algo.group_size,
                            cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                            cfg.rollout.top_k, self.scorer)
            self._prepare(batch)
            t1 = time.perf_counter()
            policy = update_policy(self.model, self.optimizer, self.scheduler, batch, self.settings)
            t2 = time.perf_counter()
            metrics = rollout_metrics(batch)
            metrics.update({POLICY_KEYS.get(k, f"policy/{k}"): v for k, v in policy.items()})
            values = to_floats(metrics)
            step_tokens = values["length/mean"] * batch.num_sequences
            tokens += step_tokens
            values.update({"optim/lr": self.scheduler.get_last_lr()[0], "reward/errors": float(self.scorer.errors),
                           "time/rollout_s": t1 - t0, "time/update_s": t2 - t1,
                           "perf/tokens_per_s": step_tokens / max(t2 - t0, 1e-9)})
            if tr.eval_every > 0 and (step % tr.eval_every == 0 or step == tr.steps):
                values.update(self._evaluate())
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
