"""The training loop: rollout -> prepare (old and reference log-probs, advantages) ->
minibatch updates -> log; ``in_reward`` KL shapes the rewards (Ziegler et al., 2019)."""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from rlctl.dist.backends import TorchBackend
from rlctl.core import (ADVANTAGE_ESTIMATORS, AdaptiveKLController, FixedKLController,
                        broadcast_to_tokens, kl_shaped_rewards, masked_whiten, overlong_penalty)
from rlctl.errors import Interrupted, TrainingFault
from rlctl.train.evaluate import evaluate, means
from rlctl.models.forward import PromptGroups, learner_forward, prompt_sharing
from rlctl.models.kv_share import innermost
from rlctl.train.metrics import (draw_rows, named_reward_metrics,
                                   reduce_metrics, rollout_metrics, train_rows, user_prompts)
from rlctl.train.update import (UpdateSettings, UpdateState, activation_bytes, needs_reference,
                                nothing_trained, old_policy_inputs, pair_sums, update_mask,
                                update_policy)
from rlctl.envs.environment import is_episodic
from rlctl.models.stop_ids import stop_ids
from rlctl.rollout.generate import check_training_sampling
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.source import Source, collect
from rlctl.config.schema import AlgoConfig, SamplesConfig, TrainerConfig
from rlctl.stopping import StopFlag
from rlctl.storage import checkpoint
from rlctl.tasks.prompt_budget import Prepared
from rlctl.types import RolloutBatch


def shaped_task_rewards(batch: RolloutBatch, s: UpdateSettings) -> torch.Tensor:
    """Task (or episode) reward plus the DAPO overlong penalty when configured. -> [N]"""
    return batch.rewards + overlong(batch, s) if s.algo.overlong_buffer > 0 else batch.rewards


def overlong(batch: RolloutBatch, s: UpdateSettings) -> torch.Tensor:
    """DAPO's overlong penalty [N] (0 when off) of the counted tokens against
    ``max_new_tokens``, or of an episode's transcript against ``episode_max_tokens``."""
    buffer, penalty = s.algo.overlong_buffer, s.algo.overlong_penalty
    if buffer <= 0:
        return torch.zeros_like(batch.rewards)
    if batch.episodes is None:
        return overlong_penalty(batch.mask.sum(-1), s.max_new_tokens, buffer, penalty)
    lengths = batch.attention_mask[:, batch.prompt_len:].sum(-1)          # [N]
    return overlong_penalty(lengths, s.episode_max_tokens, buffer, penalty)


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, backend, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and unbiased variance over every rank's tokens, two
    passes in float64; two collectives. Returns x's dtype, 0 where mask == 0."""
    if backend is None or backend.world_size == 1:
        return masked_whiten(x, mask, eps=eps) * mask
    m = mask.double()                                                   # [N, T]
    xd = torch.where(mask != 0, x.double(), 0.0)     # [N, T]; a NaN/inf not counted cannot leak
    n, s1 = backend.all_reduce(torch.stack([m.sum(), (xd * m).sum()]))
    centred = (xd - s1 / n.clamp(min=1)) * m                            # [N, T]
    var = backend.all_reduce(centred.square().sum()) / (n - 1).clamp(min=1)
    return (centred * torch.rsqrt(var + eps)).to(x.dtype)


def compute_advantages(batch: RolloutBatch, s: UpdateSettings, kl_coef: float,
                       values: Optional[torch.Tensor], backend=None
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(advantages [N, T], returns [N, T] or None); ``values`` [N, T] for GAE. With several
    ranks, outcome estimators see every rank's groups and whitening is global."""
    if s.kl_in_reward and kl_coef > 0:   # the trainer computes old log-probs for this case
        kl = (batch.logprobs.old, batch.logprobs.ref, batch.mask, kl_coef, s.kl_estimator)
    else:
        zero = torch.zeros_like(batch.mask)
        kl = (zero, zero, batch.mask, 0.0)
    seq_return = None
    if batch.episodes is None:      # the reward on the last counted token, KL shaping
        per_token = kl_shaped_rewards(shaped_task_rewards(batch, s), *kl)            # [N, T]
    else:       # episodes: the placed turn rewards, plus the shaping (KL, overlong penalty)
        shaping = kl_shaped_rewards(overlong(batch, s), *kl)                         # [N, T]
        per_token = batch.episodes.token_rewards.to(shaping.dtype) + shaping        # [N, T]
        seq_return = batch.rewards.to(shaping.dtype) + (shaping * batch.mask).sum(-1)   # [N]
    returns = None
    a = s.algo
    entry = ADVANTAGE_ESTIMATORS.entry(a.advantage)
    if entry.level == "token":
        adv, returns = entry.fn(per_token, values, batch.mask, a.gamma, a.lam)   # [N, T] each
    else:
        if seq_return is None:
            seq_return = (per_token * batch.mask).sum(-1)                         # [N]
        seq_return = seq_return.view(-1, batch.group_size)                        # [B, G]
        first = 0
        if backend is not None and backend.world_size > 1:
            seq_return, first = backend.all_gather_rows(seq_return)              # [B_all, G]
        adv = entry.fn(seq_return, a.std_eps, baseline=a.baseline)               # [B_all, G]
        adv = adv[first: first + batch.num_sequences // batch.group_size]         # [B, G]
        adv = broadcast_to_tokens(adv, batch.mask)                                # [N, T]
    if a.whiten_advantages:
        adv = whiten_over_ranks(adv, batch.mask, backend)
    return adv, returns


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens_per_s: float
    eval_start: Dict[str, float] = field(default_factory=dict)
    eval_end: Dict[str, float] = field(default_factory=dict)
    last_metrics: Dict[str, float] = field(default_factory=dict)


def needs_old_forward(algo) -> bool:
    """Whether a step needs pi_old's forward (``algo``: the config's section): several
    passes, a critic, KL in the reward, adaptive KL, or the correction without bypass."""
    rc = algo.rollout_correction
    return (algo.epochs * algo.minibatches > 1 or algo.critic != "none"
            or (algo.kl.placement == "in_reward" and algo.kl.coef > 0) or algo.kl.target is not None
            or (rc.enabled and not rc.bypass))


class Trainer:
    """The loop over one rank's steps: ``algo``, ``trainer``, ``samples``: the config's sections;
    ``model``: the policy or a PolicyValueModel; ``source``: the rollouts; ``critic`` or None."""

    def __init__(self, algo: AlgoConfig, trainer: TrainerConfig, update: UpdateSettings,
                 samples: SamplesConfig, model, tokenizer, prepared: Prepared, sink, *,
                 source: Source, backend, lr: float, seed: int, eval_max_new_tokens: int,
                 critic=None, ref_model=None):
        self.algo, self.trainer_cfg, self.update_settings, self.samples = algo, trainer, update, samples
        self.seed, self.eval_max_new_tokens = seed, eval_max_new_tokens
        self.old_forward = needs_old_forward(algo)
        self.tokenizer, self.task, self.sink, self.source = tokenizer, prepared.task, sink, source
        self.critic, self.backend = critic, backend
        kl = algo.kl
        self.kl_ctl = (AdaptiveKLController(kl.coef, kl.target, kl.horizon)
                       if kl.target is not None else FixedKLController(kl.coef))
        self.shared_critic = isinstance(model, PolicyValueModel)
        if ref_model is None and needs_reference(algo):      # pi_ref: the policy's start, frozen
            ref_model = copy.deepcopy(model.policy if self.shared_critic else model)
            ref_model.eval().requires_grad_(False)
        self.ref_model = ref_model
        self.local_prompts = trainer.prompts_per_step // backend.world_size   # compose() checks
        mb = update.micro_batch_size       # pairs per forward off the update: its micro-batch
        self.pair_chunk = -(-mb // 2) if mb else max(1, self.local_prompts // algo.minibatches)
        if algo.get("precompute_ref_logps") and ref_model is not None:   # each pair's once
            source.cache_reference(lambda b: learner_forward(
                ref_model, b.input_ids, b.attention_mask, b.prompt_len, update.temperature).logp,
                self.pair_chunk)
            self.ref_model = None            # no reference model held while training
        self.model = backend.prepare(model, critic, lr, tuple(trainer.betas), trainer.weight_decay,
                                     trainer.warmup_steps, trainer.max_grad_norm)
        self.policy = backend.unwrap()      # the plain module (generation, saving), found once
        if trainer.compile:      # learner forwards only; generation keeps the eager module
            self.model = torch.compile(self.model, dynamic=True)
        self.scorer = source.scorer              # training rewards (time limit, error policy)
        self.eval_scorer = prepared.scorer()    # kept apart so eval never mixes into reward/*
        self.eval_examples = list(prepared.eval)
        self.user_prompts = user_prompts([*prepared.train, *prepared.eval])   # the sample tables
        self.warned = set()                      # nothing_trained causes said (once per run)

    @classmethod
    def from_config(cls, cfg, model, tokenizer, prepared: Prepared, sink, *, source, critic=None,
                    ref_model=None, backend=None) -> "Trainer":
        """The Trainer for the composed config ``cfg`` (``backend``: default torch)."""
        check_training_sampling(cfg.rollout.top_k)     # sampler = learner distribution
        backend = backend or TorchBackend(cfg.hardware.device)
        lora, tr = cfg.model.lora, cfg.trainer
        conf = getattr(innermost(model), "config", None)
        conf = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
        token_bytes = 0 if backend.world_size > 1 else activation_bytes(   # ranks would split unalike
            getattr(conf, "hidden_size", 0) or 0, getattr(conf, "num_hidden_layers", 0) or 0,
            cfg.hardware.precision == "bf16" or cfg.model.dtype in ("bfloat16", "float16"),
            cfg.model.gradient_checkpointing)
        if tr.activation_mb and not token_bytes and backend.is_main:    # 0: no limit asked
            why = f"{backend.world_size} ranks (their widest rows differ)" if backend.world_size > 1 \
                else "a model config without hidden_size / num_hidden_layers"
            print(f"rlctl: warning: trainer.activation_mb={tr.activation_mb} does not apply with {why}; "
                  "the update splits by trainer.micro_batch_size alone", file=sys.stderr, flush=True)
        update = UpdateSettings.from_config(cfg, prompt_sharing(tr.share_prompts, backend),
                                            is_episodic(prepared.task), token_bytes)
        return cls(cfg.algo, tr, update, cfg.logger.samples, model, tokenizer, prepared, sink,
                   source=source, backend=backend, critic=critic, ref_model=ref_model,
                   seed=cfg.seed, eval_max_new_tokens=cfg.rollout.max_new_tokens,
                   lr=lora.lr if lora.enabled and lora.lr is not None else tr.lr)

    def close(self) -> None:
        """Stop the rollout source (engine processes, reward workers) and the eval reward workers."""
        self.source.close()
        self.eval_scorer.close()

    @property
    def prompt_rng(self):
        """The source's prompt RNG (a ``random.Random``; its state is checkpointed)."""
        return self.source.prompt_rng

    @torch.no_grad()
    def _prepare(self, batch: RolloutBatch, prompts: Optional[PromptGroups]) -> RolloutBatch:
        """The batch with old/reference log-probs and values where needed, advantages and
        returns (``prompts``: rows sharing a prompt, or None). Stale async rows keep the
        behaviour log-probs; on-policy ones (``logprobs.behaviour_rows``) get pi_old's."""
        args = (batch.input_ids, batch.attention_mask, batch.prompt_len,
                self.update_settings.temperature)
        share = prompts if prompts is not None else False
        corr = self.update_settings.rollout_correction
        if corr is not None:
            batch = old_policy_inputs(batch, corr)
        lp = batch.logprobs
        old, values, mixed = lp.old, batch.old_values, lp.behaviour_rows is not None
        if mixed or self.old_forward and (old is None or self.algo.critic != "none"):
            self.model.eval()
            f = learner_forward(self.model, *args, critic=self.critic, share_prompts=share)
            values = f.values
            if old is None:
                old = f.logp
            elif mixed:          # stale rows keep the behaviour log-probs exactly
                old = torch.where(lp.behaviour_rows[:, None], old, f.logp)
        ref = lp.ref if lp.ref is not None or self.ref_model is None else \
            learner_forward(self.ref_model, *args, share_prompts=share).logp
        out = batch.replace(logprobs=dict(old=old, ref=ref, behaviour_rows=None), old_values=values)
        advantages, returns = compute_advantages(out, self.update_settings, self.kl_ctl.coef, values,
                                                 self.backend)
        return out.replace(advantages=advantages, returns=returns)

    def _evaluate(self, step: int) -> Dict[str, float]:
        """Greedy eval after ``step``: each rank takes every world_size-th example, the sums
        are reduced; with samples on, rank 0's first logger.samples.n rows go to the sink."""
        b, samples = self.backend, self.samples
        with b.sampling(self.policy):
            ev = evaluate(self.policy, self.tokenizer, self.eval_examples[b.rank::b.world_size],
                          scorer=self.eval_scorer, player=self.source.player,
                          max_new_tokens=self.eval_max_new_tokens,
                          keep=samples.n if samples.every > 0 and b.is_main else 0, step=step,
                          **b.generate_kwargs())
        if ev.rows:
            self.sink.samples(ev.rows, step, "eval")
        sums = dict(ev.sums, **self._pair_sums() if self.update_settings.preference else {})
        return {f"eval/{k}": v for k, v in means(sums, b.all_reduce).items()}

    @torch.no_grad()
    def _pair_sums(self) -> Dict[str, float]:
        """Held-out pairs (this rank's share; one per eval example, about self.pair_chunk
        per forward): sums of the pairwise accuracy and margin of the implicit rewards and of
        the preference loss."""
        b, source, s = self.backend, self.source, self.update_settings
        index = list(range(len(source.eval_examples)))[b.rank::b.world_size]
        # as many forwards on every rank, none empty (each rank has >= N // world pairs)
        parts = max(1, -(-(len(source.eval_examples) // b.world_size) // self.pair_chunk))
        out = dict.fromkeys(("pairwise_accuracy", "margin", "preference_loss"), 0.0)
        self.model.eval()
        for part in (index[i::parts] for i in range(parts)):
            batch = source.batch("eval", part)
            args = (batch.input_ids, batch.attention_mask, batch.prompt_len, s.temperature)
            if batch.logprobs.ref is None and self.ref_model is not None:
                batch = batch.replace(logprobs=dict(ref=learner_forward(self.ref_model, *args).logp))
            f = learner_forward(self.model, *args)
            loss, m = pair_sums(s.preference, f.logp, batch, batch.mask)
            for k, v in (("pairwise_accuracy", m["rewards/accuracy"]),
                         ("margin", m["rewards/margins"]), ("preference_loss", loss)):
                out[k] += float(v)
        return out

    def step(self, step: int) -> Dict[str, float]:
        a = self.algo
        t0, score0 = time.perf_counter(), self.scorer.seconds
        self.model.eval()
        with self.backend.sampling(self.policy):        # FSDP2: the weights whole
            batch, kept = collect(self.source.sample, self.local_prompts, a.dynamic_sampling,
                                  a.max_sampling_rounds, self.tokenizer.pad_token_id)
        t_gen, score_s = time.perf_counter(), self.scorer.seconds - score0
        prompts = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len) \
            if self.update_settings.share_prompts else None                  # found on the CPU
        batch = self._prepare(batch, prompts)
        t1 = time.perf_counter()
        frozen = step <= a.critic_warmup_steps
        if self.shared_critic:
            self.policy.detach_backbone = frozen
        state = UpdateState(kl_coef=self.kl_ctl.coef, policy_frozen=frozen)
        metrics = update_policy(self.model, self.backend, batch, self.update_settings, state,
                                self.critic, prompts)
        self.source.after_update()
        t2 = time.perf_counter()
        metrics.update(rollout_metrics(batch, kept, self.update_settings.preference is not None))
        metrics.update(named_reward_metrics(*self.scorer.named_sums(), self.backend))
        values = reduce_metrics(metrics, self.backend)
        tokens = values.pop("perf/step_tokens")
        sequences = int(values.pop("perf/step_sequences"))
        values.update({"kl/coef": self.kl_ctl.coef,
                       "optim/lr": self.backend.lr(),
                       **self.scorer.metrics(),        # the counts (named means: above)
                       "time/rollout_s": t1 - t0, "time/update_s": t2 - t1,
                       "time/generate_s": t_gen - t0 - score_s, "time/score_s": score_s,
                       "time/logprob_s": t1 - t_gen,     # old/reference forwards + advantages
                       "perf/tokens_per_s": tokens / max(t2 - t0, 1e-9)})
        values.update(self.source.metrics())      # async: staleness, waits
        cause = nothing_trained(values)
        if cause is not None and cause not in self.warned and self.backend.is_main:
            self.warned.add(cause)
            print(f"rlctl: warning: step {step}: {cause} (said once)", file=sys.stderr, flush=True)
        if "kl/seq_k1" in values:
            self.kl_ctl.update(values["kl/seq_k1"], sequences)   # horizon counts sequences (Ziegler et al.)
        samples = self.samples
        if samples.every > 0 and self.backend.is_main \
                and (step % samples.every == 0 or step == self.trainer_cfg.steps):   # and at the last step
            self._log_samples(batch, step)
        return values

    def _log_samples(self, batch: RolloutBatch, step: int) -> None:
        """The step's sample table: a few whole groups drawn with their own RNG."""
        rows = draw_rows(batch.num_sequences, batch.group_size, self.samples.n, self.seed, step)
        rewards = shaped_task_rewards(batch, self.update_settings)               # [N]
        player = self.source.player
        tool_task = batch.episodes is not None and player is not None and player.tool_task
        self.sink.samples(train_rows(batch, rows, step, rewards, self.tokenizer,
                                     stop_ids(self.policy, self.tokenizer), tool_task,
                                     update_mask(batch, self.update_settings.algo),
                                     self.user_prompts),
                          step, "train")

    def train(self, run_dir=None, resume_from=None, on_step=None, stop=None) -> TrainResult:
        """The loop, checkpointing into ``run_dir`` every ``trainer.checkpoint_every`` steps and at
        the end; a signal saves and raises ``Interrupted``, ``max_bad_steps`` bad steps ``TrainingFault``."""
        tr = self.trainer_cfg
        t_start, tokens, bad_streak = time.perf_counter(), 0.0, 0
        result = TrainResult(steps=tr.steps, seconds=0.0, tokens_per_s=0.0)
        first = self._start(result, resume_from)
        stop = stop or StopFlag()
        with stop.installed():
            for step in range(first, tr.steps + 1):
                values = self.step(step)
                tokens += values["perf/tokens_per_s"] * (values["time/rollout_s"] + values["time/update_s"])
                updates = self.algo.epochs * self.algo.minibatches
                bad_streak = bad_streak + 1 if values.get("fault/skipped_steps", 0) >= updates else 0
                if tr.eval_every > 0 and (step % tr.eval_every == 0 or step == tr.steps):
                    values.update(self._evaluate(step))
                values["time/elapsed_s"] = time.perf_counter() - t_start
                if step % tr.log_every == 0 or step == tr.steps:
                    self.sink.log(values, step=step)
                result.last_metrics = values
                if on_step is not None:
                    on_step(step, values)
                if bad_streak >= tr.max_bad_steps:
                    last = checkpoint.latest_checkpoint(run_dir) if run_dir is not None else None
                    raise TrainingFault(
                        f"stopped at step {step}: {bad_streak} steps in a row had a non-finite loss "
                        f"or gradient (trainer.max_bad_steps={tr.max_bad_steps}); last good "
                        f"checkpoint: {last or 'none'}")
                signum = stop.agreed(self.backend)       # all ranks stop after the same step
                if signum and step < tr.steps:          # finish the step, save, leave
                    self._save(run_dir, step, result)
                    raise Interrupted(run_dir, step, signum)
                if tr.checkpoint_every > 0 and step % tr.checkpoint_every == 0 and step < tr.steps:
                    self._save(run_dir, step, result)
        self._save(run_dir, tr.steps, result)
        result.seconds = time.perf_counter() - t_start
        result.tokens_per_s = tokens / max(result.seconds, 1e-9)
        if tr.eval_every > 0:
            result.eval_end = {k: v for k, v in result.last_metrics.items() if k.startswith("eval/")} \
                or self._evaluate(tr.steps)
        return result

    def _start(self, result: TrainResult, resume_from) -> int:
        """The first step to run: after the checkpoint's, or 1 (after the start's eval)."""
        if resume_from is not None:
            state = checkpoint.load(self, resume_from)
            result.eval_start = state.get("eval_start", {})
            self.scorer.load_state(state.get("scorer", {}))
            return state["step"] + 1
        if self.trainer_cfg.eval_every > 0:
            result.eval_start = self._evaluate(0)
            self.sink.log(result.eval_start, step=0)
        return 1

    def _save(self, run_dir, step: int, result: TrainResult) -> None:
        if run_dir is not None:
            checkpoint.save(self, run_dir, step, {"eval_start": result.eval_start,
                                                  "scorer": self.scorer.state()},
                            self.trainer_cfg.keep_checkpoints)


