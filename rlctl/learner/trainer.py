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
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from rlctl.backends.base import TorchBackend
from rlctl.core import AdaptiveKLController, FixedKLController, masked_mean
from rlctl.errors import Interrupted, TrainingFault
from rlctl.models.stop_ids import stop_ids
from rlctl.learner.advantage import AdvantageSettings, compute_advantages, shaped_task_rewards
from rlctl.learner.correction import old_policy_inputs
from rlctl.learner.evaluate import evaluate, means
from rlctl.learner.forward import PromptGroups, learner_forward, prompt_sharing
from rlctl.learner.samples import SampleSettings, draw_rows, offers_tools, train_rows
from rlctl.learner.stats import Moments, reduce_metrics, rollout_metrics
from rlctl.learner.update import UpdateSettings, UpdateState, update_policy
from rlctl.rollout.source import collect
from rlctl.rollout.generate import check_training_sampling
from rlctl.schema import AlgoConfig, TrainerConfig
from rlctl.stopping import StopFlag
from rlctl.storage import checkpoint
from rlctl.tasks.prompt_budget import Prepared
from rlctl.types import RolloutBatch


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens_per_s: float
    eval_start: Dict[str, float] = field(default_factory=dict)
    eval_end: Dict[str, float] = field(default_factory=dict)
    last_metrics: Dict[str, float] = field(default_factory=dict)


def frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def needs_old_forward(algo) -> bool:
    """Whether a step needs pi_old's forward before the update: several passes over the
    rollout, a critic's values, KL shaped into the reward, an adaptive KL coefficient, or
    the rollout correction without bypass (its weight is pi_old / pi_engine).
    ``algo``: the config's ``algo`` section."""
    rc = algo.rollout_correction
    return (algo.epochs * algo.minibatches > 1 or algo.critic != "none"
            or (algo.kl.placement == "in_reward" and algo.kl.coef > 0) or algo.kl.target is not None
            or (rc.enabled and not rc.bypass))


class Trainer:
    """``algo``, ``trainer``: the config's sections, read directly (DictConfig nodes over
    the schema's dataclasses, or the dataclasses);
    ``update``/``advantage``: the update's and the advantage estimator's settings;
    ``samples``: the sample tables'; ``lr``: model.lora.lr when LoRA sets one, else
    trainer.lr; ``eval_max_new_tokens``: rollout.max_new_tokens (``Trainer.from_config``
    builds all of these from the config); ``model``: the policy, or a PolicyValueModel (shared critic);
    ``prepared``: the task prepared for the model (``rlctl.tasks.prompt_budget.Prepared``:
    the eval prompts and the eval scorer come from it);
    ``source``: where rollouts come from (``build_source``: it samples with this same
    ``model``, and owns the prompt sampler and the training reward scorer); ``critic``: a
    separate value model or None; ``backend``: how to step and how ranks communicate
    (each rank samples its own share of the step's prompts, whole groups only)."""

    def __init__(self, algo: AlgoConfig, trainer: TrainerConfig, update: UpdateSettings,
                 advantage: AdvantageSettings, samples: SampleSettings, model, tokenizer, prepared: Prepared,
                 sink, *, source, backend, lr: float, eval_max_new_tokens: int, critic=None,
                 ref_model=None):
        self.algo, self.tr, self.samples = algo, trainer, samples
        self.old_forward, self.eval_max_new_tokens = needs_old_forward(algo), eval_max_new_tokens
        self.tokenizer, self.task, self.sink, self.source = tokenizer, prepared.task, sink, source
        self.critic, self.backend = critic, backend
        self.settings, self.adv_settings = update, advantage     # the update's, the advantages'
        kl = algo.kl
        self.kl_ctl = (AdaptiveKLController(kl.coef, kl.target, kl.horizon)
                       if kl.target is not None else FixedKLController(kl.coef))
        self.ref_model = ref_model if ref_model is not None else (
            frozen_copy(getattr(model, "policy", model)) if kl.coef > 0 else None)
        self.model = self.backend.prepare(model, critic, lr, tuple(trainer.betas), trainer.weight_decay,
                                          trainer.warmup_steps, trainer.max_grad_norm)
        if trainer.compile:      # learner forwards only; generation keeps the eager module
            self.model = torch.compile(self.model, dynamic=True)
        self.scorer = source.scorer              # training rewards (time limit, error policy)
        self.eval_scorer = prepared.scorer()    # kept apart so eval never mixes into reward/*
        self.eval_examples = list(prepared.eval)
        self.local_prompts = trainer.prompts_per_step // self.backend.world_size   # compose() checks

    @classmethod
    def from_config(cls, cfg, model, tokenizer, prepared: Prepared, sink, *, source, critic=None,
                    ref_model=None, backend=None) -> "Trainer":
        """The Trainer for the composed config ``cfg`` (read here, once): its sampling
        checked (``rollout.top_k``), ``backend`` by default the torch one on
        ``hardware.device``; the learner's prompt sharing goes by its own backend (off
        under multi-rank ZeRO-3), whatever the source was built with."""
        check_training_sampling(cfg.rollout.top_k)     # sampler = learner distribution
        backend = backend or TorchBackend(cfg.hardware.device)
        share = prompt_sharing(cfg.trainer.share_prompts, backend)
        lora, tr = cfg.model.lora, cfg.trainer
        return cls(cfg.algo, tr,
                   UpdateSettings.from_config(cfg, share), AdvantageSettings.from_config(cfg),
                   SampleSettings(cfg.logger.samples.every, cfg.logger.samples.n, cfg.seed),
                   model, tokenizer, prepared, sink, source=source, backend=backend, critic=critic,
                   ref_model=ref_model, eval_max_new_tokens=cfg.rollout.max_new_tokens,
                   lr=lora.lr if lora.enabled and lora.lr is not None else tr.lr)

    def close(self) -> None:
        """Stop the rollout source (engine processes, reward workers) and the eval reward workers."""
        self.source.close()
        self.eval_scorer.close()

    @property
    def policy(self):
        """The plain module (generation, saving): unwrapped from the backend's engine."""
        return self.backend.unwrap()

    @property
    def sampler(self):
        """The prompt sampler (a ``random.Random``; its state is checkpointed)."""
        return self.source.prompt_rng

    # ---- rollout side -------------------------------------------------------------
    @torch.no_grad()
    def _prepare(self, batch: RolloutBatch, prompts: Optional[PromptGroups]) -> RolloutBatch:
        """The batch with old/reference log-probs and values where needed, advantages and
        returns. ``prompts``: which rows share a prompt (None: no prompt sharing)."""
        args = (batch.input_ids, batch.attention_mask, batch.prompt_len, self.settings.temperature)
        share = prompts if prompts is not None else False
        batch = old_policy_inputs(batch, self.settings.rollout_correction)   # off: unchanged
        old, values = self._old_forward(batch, args, share)
        ref = learner_forward(self.ref_model, *args, share_prompts=share).logp \
            if self.ref_model is not None else None
        out = batch.replace(old_logprobs=old, old_values=values, ref_logprobs=ref, behaviour_rows=None)
        advantages, returns = compute_advantages(out, self.adv_settings, self.kl_ctl.coef, values,
                                                 self.backend)
        return out.replace(advantages=advantages, returns=returns)

    def _old_forward(self, batch: RolloutBatch, args, share):
        """(old log-probs [N, T] or None, critic values [N, T] or None). Async: a stale
        rollout keeps the behaviour policy's log-probs; the forward is then only needed
        for a critic's values, or (a step mixing stale and on-policy rollouts:
        ``behaviour_rows``) for pi_old of the on-policy rows."""
        mixed = batch.behaviour_rows is not None
        if not (mixed or self.old_forward and (
                batch.old_logprobs is None or self.algo.critic != "none")):
            return batch.old_logprobs, batch.old_values
        self.model.eval()
        f = learner_forward(self.model, *args, critic=self.critic, share_prompts=share)
        if batch.old_logprobs is None:
            return f.logp, f.values
        if mixed:                # stale rows keep the behaviour log-probs exactly
            return torch.where(batch.behaviour_rows[:, None], batch.old_logprobs, f.logp), f.values
        return batch.old_logprobs, f.values

    def _evaluate(self, step: int) -> Dict[str, float]:
        """Greedy eval after ``step`` (``rlctl.learner.evaluate``: greedy episodes when the
        source plays them); each rank takes every world_size-th example, sums are
        reduced. With samples on, rank 0's first logger.samples.n rows go to the sink."""
        b, samples = self.backend, self.samples
        ev = evaluate(self.policy, self.tokenizer, self.eval_examples[b.rank::b.world_size],
                      scorer=self.eval_scorer, player=getattr(self.source, "player", None),
                      max_new_tokens=self.eval_max_new_tokens,
                      keep=samples.n if samples.on and b.is_main else 0, step=step,
                      **b.generate_kwargs())
        if ev.rows:
            self.sink.samples(ev.rows, step, "eval")
        return {f"eval/{k}": v for k, v in means(ev.sums, b.all_reduce_sum).items()}

    # ---- the loop -------------------------------------------------------------------
    def step(self, step: int) -> Dict[str, float]:
        a = self.algo
        t0, score0 = time.perf_counter(), self.scorer.seconds
        self.model.eval()
        batch, kept = collect(self.source.sample, self.local_prompts, a.dynamic_sampling,
                              a.max_sampling_rounds, self.tokenizer.pad_token_id)
        t_gen, score_s = time.perf_counter(), self.scorer.seconds - score0
        prompts = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.prompt_len) \
            if self.settings.share_prompts else None                         # found on the CPU
        batch = self._prepare(batch, prompts)
        t1 = time.perf_counter()
        frozen = step <= a.critic_warmup_steps
        if hasattr(self.policy, "detach_backbone"):
            self.policy.detach_backbone = frozen
        state = UpdateState(kl_coef=self.kl_ctl.coef, policy_frozen=frozen)
        metrics = update_policy(self.model, self.backend, batch, self.settings, state, self.critic,
                                prompts)
        self.source.after_update()
        t2 = time.perf_counter()
        metrics.update(rollout_metrics(batch, kept))
        metrics.update(_step_metrics(batch))
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
        if "kl/seq_k1" in values:
            self.kl_ctl.update(values["kl/seq_k1"], sequences)   # horizon counts sequences (Ziegler et al.)
        if self.samples.due(step, self.tr.steps) and self.backend.is_main:
            self._log_samples(batch, step)
        return values

    def _log_samples(self, batch: RolloutBatch, step: int) -> None:
        """The step's sample table (rlctl/learner/samples.py): a few whole groups, drawn
        with an RNG of their own, read back and decoded alone."""
        n, seed = self.samples.n, self.samples.seed
        rows = draw_rows(batch.num_sequences, batch.group_size, n, seed, step)
        rewards = shaped_task_rewards(batch, self.adv_settings)                  # [N]
        player = getattr(self.source, "player", None)     # a source that plays episodes
        tool_task = batch.episodes is not None and player is not None and offers_tools(player.task)
        self.sink.samples(train_rows(batch, rows, step, rewards, self.tokenizer,
                                     stop_ids(self.policy, self.tokenizer), tool_task),
                          step, "train")

    def train(self, run_dir=None, resume_from=None, on_step=None, stop=None) -> TrainResult:
        """The loop. With ``run_dir``, checkpoints every ``trainer.checkpoint_every`` steps
        and at the end; ``resume_from`` (a checkpoint dir) continues after its step.
        SIGINT/SIGTERM (``stop``: a StopFlag, else one is installed here) finish the step,
        save a checkpoint and raise ``Interrupted``; ``trainer.max_bad_steps``
        consecutive steps whose updates were all skipped (non-finite) raise
        ``TrainingFault`` (the newest checkpoint predates them)."""
        o = self.tr
        t_start, tokens, bad_streak = time.perf_counter(), 0.0, 0
        result = TrainResult(steps=o.steps, seconds=0.0, tokens_per_s=0.0)
        first = self._start(result, resume_from)
        stop = stop or StopFlag()
        with stop.installed():
            for step in range(first, o.steps + 1):
                values = self.step(step)
                tokens += values["perf/tokens_per_s"] * (values["time/rollout_s"] + values["time/update_s"])
                updates = self.settings.epochs * self.settings.minibatches
                bad_streak = bad_streak + 1 if values.get("fault/skipped_steps", 0) >= updates else 0
                if o.eval_every > 0 and (step % o.eval_every == 0 or step == o.steps):
                    values.update(self._evaluate(step))
                values["time/elapsed_s"] = time.perf_counter() - t_start
                if step % o.log_every == 0 or step == o.steps:
                    self.sink.log(values, step=step)
                result.last_metrics = values
                if on_step is not None:
                    on_step(step, values)
                self._after_step(step, bad_streak, run_dir, result, stop)
        self._save(run_dir, o.steps, result)
        result.seconds = time.perf_counter() - t_start
        result.tokens_per_s = tokens / max(result.seconds, 1e-9)
        if o.eval_every > 0:
            result.eval_end = {k: v for k, v in result.last_metrics.items() if k.startswith("eval/")} \
                or self._evaluate(o.steps)
        return result

    def _start(self, result: TrainResult, resume_from) -> int:
        """The first step to run: after the checkpoint's, or 1 (after the start's eval)."""
        if resume_from is not None:
            state = checkpoint.load(self, resume_from)
            result.eval_start = state.get("eval_start", {})
            self.scorer.load_state(state.get("scorer", {}))
            return state["step"] + 1
        if self.tr.eval_every > 0:
            result.eval_start = self._evaluate(0)
            self.sink.log(result.eval_start, step=0)
        return 1

    def _save(self, run_dir, step: int, result: TrainResult) -> None:
        if run_dir is not None:
            checkpoint.save(self, run_dir, step, {"eval_start": result.eval_start,
                                                  "scorer": self.scorer.state()},
                            self.tr.keep_checkpoints)

    def _after_step(self, step: int, bad_streak: int, run_dir, result: TrainResult, stop) -> None:
        """Stop on too many non-finite steps or on a signal (saved first); checkpoint."""
        o = self.tr
        if bad_streak >= o.max_bad_steps:
            last = checkpoint.latest_checkpoint(run_dir) if run_dir is not None else None
            raise TrainingFault(
                f"stopped at step {step}: {bad_streak} steps in a row had a non-finite loss "
                f"or gradient (trainer.max_bad_steps={o.max_bad_steps}); last good "
                f"checkpoint: {last or 'none'}")
        signum = stop.agreed(self.backend)       # all ranks stop after the same step
        if signum and step < o.steps:           # finish the step, save, leave
            self._save(run_dir, step, result)
            raise Interrupted(run_dir, step, signum)
        if o.checkpoint_every > 0 and step % o.checkpoint_every == 0 and step < o.steps:
            self._save(run_dir, step, result)


def _step_metrics(batch: RolloutBatch) -> Dict[str, torch.Tensor]:
    """Value targets' mean, the per-sequence KL to the reference, and the counts the
    throughput needs (summed over ranks)."""
    out = {"perf/step_tokens": batch.mask.sum(),
           "perf/step_sequences": torch.tensor(float(batch.num_sequences))}
    if batch.returns is not None:
        out["value/return_mean"] = masked_mean(batch.returns, batch.mask)
    if batch.ref_logprobs is not None and batch.old_logprobs is not None:
        out["kl/seq_k1"] = ((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum(-1).mean()
    return out


def named_reward_metrics(sums: Dict[str, float], count: int, backend) -> Dict[str, Moments]:
    """reward/<name>: each named reward's mean over the samples every rank scored since
    the last step (the sum of the ranks' sums over the sum of their counts), as `Moments`
    that `reduce_metrics` pools in its one collective. The names are the union over the
    ranks (one gather), so that every rank sends the same metrics: a rank without a name
    (every one of its samples failed, or the task names it for some samples only) counts
    0 for it, as a failed sample counts 0 on one rank."""
    n = torch.tensor(float(count), dtype=torch.float64)
    return {f"reward/{k}": Moments(n, torch.tensor([sums.get(k, 0.0) / max(count, 1)],
                                                   dtype=torch.float64),
                                   torch.zeros(1, dtype=torch.float64), _first_mean)
            for k in _names_of_every_rank(sorted(sums), backend)}


def _names_of_every_rank(names: List[str], backend) -> List[str]:
    if backend.world_size == 1:
        return names
    blob = torch.tensor(list("".join(f"{k}\n" for k in names).encode() + b"\n"),
                        dtype=torch.uint8)                              # [bytes]
    rows, _ = backend.all_gather_rows(blob)                             # [every rank's bytes]
    return sorted({k for k in bytes(rows.tolist()).decode().split("\n") if k})


def _first_mean(m: Moments) -> torch.Tensor:
    return m.mean[0]
