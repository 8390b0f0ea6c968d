"""What the training loop reads of the config, read once: ``TrainerSettings``.

``TrainerSettings.from_config`` is the only place the ``algo``, ``trainer``, ``rollout``,
``model.lora`` and ``logger.samples`` keys (and the seed) the loop uses are read; the Trainer itself holds this frozen
object (and the update's and advantages' own settings inside it), never the config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from rlctl.learner.advantage import AdvantageSettings
from rlctl.learner.samples import SampleSettings
from rlctl.learner.update import UpdateSettings


def needs_old_forward(algo) -> bool:
    """Whether a step needs pi_old's forward before the update: several passes over the
    rollout, a critic's values, KL shaped into the reward, an adaptive KL coefficient, or
    the rollout correction without bypass (its weight is pi_old / pi_engine).
    ``algo``: the config's ``algo`` section (read at the boundary: ``from_config`` below
    and the dry run)."""
    rc = algo.get("rollout_correction")
    return (algo.epochs * algo.minibatches > 1 or algo.critic != "none"
            or (algo.kl.placement == "in_reward" and algo.kl.coef > 0) or algo.kl.target is not None
            or (rc is not None and rc.enabled and not rc.bypass))


@dataclass(frozen=True)
class TrainerSettings:
    """The loop's settings. ``update``/``advantage``: the learner update's and the
    advantage estimator's own settings; the rest, by the key each comes from."""
    update: UpdateSettings
    advantage: AdvantageSettings
    kl_coef: float                  # algo.kl.coef (the controller's start)
    kl_target: Optional[float]      # algo.kl.target (None: a fixed coefficient)
    kl_horizon: float               # algo.kl.horizon
    lr: float                       # model.lora.lr when LoRA sets one, else trainer.lr
    betas: Tuple[float, ...]        # trainer.betas
    weight_decay: float             # trainer.weight_decay
    warmup_steps: int               # trainer.warmup_steps
    max_grad_norm: float            # trainer.max_grad_norm
    compile: bool                   # trainer.compile
    prompts_per_step: int           # trainer.prompts_per_step (over all ranks)
    dynamic_sampling: bool          # algo.dynamic_sampling
    max_sampling_rounds: int        # algo.max_sampling_rounds
    old_forward: bool               # needs_old_forward(algo)
    critic: bool                    # algo.critic != "none"
    critic_warmup_steps: int        # algo.critic_warmup_steps
    eval_max_new_tokens: int        # rollout.max_new_tokens (the eval's generation limit)
    steps: int                      # trainer.steps
    eval_every: int                 # trainer.eval_every (0: no eval)
    log_every: int                  # trainer.log_every
    checkpoint_every: int           # trainer.checkpoint_every (0: only at the end)
    keep_checkpoints: int           # trainer.keep_checkpoints
    max_bad_steps: int              # trainer.max_bad_steps
    samples: SampleSettings         # logger.samples.every/.n and seed (learner/samples.py)

    @classmethod
    def from_config(cls, cfg, share_prompts: bool) -> "TrainerSettings":
        """From the composed config; ``share_prompts``: ``trainer.share_prompts`` as it
        applies on the learner's backend (``forward.prompt_sharing``)."""
        algo, tr, lora = cfg.algo, cfg.trainer, cfg.model.lora
        return cls(update=UpdateSettings.from_config(cfg, share_prompts),
                   advantage=AdvantageSettings.from_config(cfg),
                   kl_coef=algo.kl.coef, kl_target=algo.kl.target, kl_horizon=algo.kl.horizon,
                   lr=lora.lr if lora.enabled and lora.lr is not None else tr.lr,
                   betas=tuple(tr.betas), weight_decay=tr.weight_decay,
                   warmup_steps=tr.warmup_steps, max_grad_norm=tr.max_grad_norm,
                   compile=tr.compile, prompts_per_step=tr.prompts_per_step,
                   dynamic_sampling=algo.dynamic_sampling,
                   max_sampling_rounds=algo.max_sampling_rounds,
                   old_forward=needs_old_forward(algo), critic=algo.critic != "none",
                   critic_warmup_steps=algo.critic_warmup_steps,
                   eval_max_new_tokens=cfg.rollout.max_new_tokens, steps=tr.steps,
                   eval_every=tr.eval_every, log_every=tr.log_every,
                   checkpoint_every=tr.checkpoint_every, keep_checkpoints=tr.keep_checkpoints,
                   max_bad_steps=tr.max_bad_steps,
                   samples=SampleSettings(every=cfg.logger.samples.every, n=cfg.logger.samples.n,
                                          seed=cfg.seed))
