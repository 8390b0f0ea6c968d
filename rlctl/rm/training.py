"""`rlctl reward-model train|eval`: fit a Bradley-Terry reward model (docs/rlhf.md), measure one."""
from __future__ import annotations

import inspect
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch
import yaml
from omegaconf import OmegaConf
from safetensors import SafetensorError
from transformers import AutoTokenizer

from rlctl.config.compose import compose
from rlctl.errors import ConfigError, DataError, Interrupted, UserError
from rlctl.models.loading import (adapter_problem, check_vocab, corrupt_safetensors,
                                  disable_dropout, quiet_libraries, resolve_dtype)
from rlctl.demo.tiny import build_tiny
from rlctl.rm.settings import SECTIONS, RMConfig, rm_config, split_overrides
from rlctl.rm.fit import (Pair, classifier_from_lm, fit, pair_counts, pairwise_accuracy,
                          prepare_for_scoring, score_pairs)
from rlctl.rm.learned import RewardModel
from rlctl.rm.score import length_limit
from rlctl.sinks import build_sinks
from rlctl.sinks.console import REWARD_MODEL_KEYS
from rlctl.stopping import StopFlag
from rlctl.storage.rundir import create_run_dir, write_json_atomic
from rlctl.tasks.preference import hold_out, read_pairs


def fit_limit(rm: RMConfig, tokenizer, model_config) -> Optional[int]:
    """``rm.max_length`` (saved on the tokenizer) or the model's context; ConfigError above it."""
    context = length_limit(tokenizer, model_config)
    if rm.max_length is None:
        return context
    if context is not None and rm.max_length > context:
        raise ConfigError(f"invalid rm.max_length '{rm.max_length}'; must be <= {context}, "
                          "the model's context (null: the whole context)")
    tokenizer.model_max_length = rm.max_length
    return rm.max_length


def note_truncation(limit: Optional[int], what: str, counts: Dict[str, Tuple[int, int]],
                    stream=None) -> None:
    """One line on stderr when any pair (split: (over the limit, pairs)) is too long."""
    if not any(n for n, _ in counts.values()):
        return
    parts = " and ".join(" ".join(filter(None, (f"{n} of {total}", split, "pairs")))
                         for split, (n, total) in counts.items())
    print(f"rlctl: {what}: {parts} have a text (prompt + answer) longer than {limit} tokens; "
          f"each such text keeps its last {limit} tokens (a leading BOS stays first), the end "
          "of the answer, where the score is read", file=stream or sys.stderr, flush=True)


def check_identical(n_train: int, n_held: int, train: Sequence[Pair], held: Sequence[Pair],
                    held_key: str, stream=None) -> Dict[str, int]:
    """DataError when every training pair has chosen == rejected; one stderr line when some do."""
    if n_train == len(train):
        raise DataError(f"PREFS: all {len(train)} training pairs have chosen and rejected "
                        "reading as the same tokens (once rendered and cut to the length "
                        "limit): nothing can be learned from them (the loss stays at log 2); "
                        "give pairs whose chosen and rejected answers differ")
    if n_train or n_held:
        print(f"rlctl: {n_train} of {len(train)} training pairs and {n_held} of {len(held)} "
              f"held-out pairs ({held_key}) have chosen == rejected (the same tokens once "
              "rendered): they carry no preference (loss log 2 whatever the model) and a "
              "held-out tie counts as wrong in pairwise accuracy",
              file=stream or sys.stderr, flush=True)
    return {"train_pairs_identical": n_train, "eval_pairs_identical": n_held}


def backbone_path(name: str, name_or_path: Optional[str] = None, **tiny_kwargs) -> str:
    """The model directory the fit starts from (model=tiny: the cached tiny policy)."""
    if name == "tiny":
        accepted = inspect.signature(build_tiny).parameters
        return str(build_tiny(**{k: v for k, v in tiny_kwargs.items()
                                 if k in accepted and k != "seed" and v is not None}))
    path = Path(str(name_or_path)).expanduser()
    if not path.is_dir():
        raise UserError(f"model path '{name_or_path}' does not exist or is not a directory")
    problem = adapter_problem(path, new_adapter=False) or corrupt_safetensors(path)
    if problem:      # a LoRA adapter would load with every weight frozen
        raise UserError(f"cannot load model: {problem}")
    return str(path)


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def load_classifier(path: str, dtype: str, seed: int, device: str):
    """(1-output sequence classifier, tokenizer) from a model directory; UserError if not."""
    try:
        model = classifier_from_lm(path, resolve_dtype(dtype), seed)
        tokenizer = AutoTokenizer.from_pretrained(path)
        check_vocab(tokenizer, model, path)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        why = (corrupt_safetensors(Path(path)) if isinstance(exc, SafetensorError) else None)
        raise UserError(f"cannot load model '{path}' as a sequence classifier: "
                        f"{why or _first_line(exc)}") from None
    prepare_for_scoring(model, tokenizer)
    return model.to(device), tokenizer


def score_stats(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> Dict[str, float]:
    """Pairwise accuracy and the score distribution of chosen and rejected answers."""
    out = {"pairwise_accuracy": pairwise_accuracy(r_chosen, r_rejected),
           "num_pairs": float(len(r_chosen)),
           "mean_margin": float((r_chosen - r_rejected).mean())}
    q = torch.tensor([0.1, 0.5, 0.9])
    for name, r in (("chosen", r_chosen), ("rejected", r_rejected)):
        r = r.double()
        qs = torch.quantile(r, q.double()).tolist()
        out.update({f"{name}_mean": float(r.mean()),
                    f"{name}_std": float(r.std()) if len(r) > 1 else 0.0,
                    f"{name}_p10": qs[0], f"{name}_p50": qs[1], f"{name}_p90": qs[2]})
    return out


def _evaluate(model, tokenizer, held: Sequence[Pair], rm: RMConfig) -> Dict[str, float]:
    r_c, r_r = score_pairs(model, tokenizer, held, rm.eval_batch_size, rm.max_length)  # [P] each
    stats = score_stats(r_c, r_r)
    return {"eval/pairwise_accuracy": stats["pairwise_accuracy"],
            "eval/margin": stats["mean_margin"], "eval/chosen_mean": stats["chosen_mean"],
            "eval/rejected_mean": stats["rejected_mean"]}


def _plan(overrides: Sequence[str], prefs: str, eval_prefs: Optional[str]):
    """Everything checked before a run directory is made: (composed, rm, train, held)."""
    base, rm_overrides = split_overrides(overrides)
    composed = compose(base)
    rm = rm_config(rm_overrides)
    hw = composed.cfg.hardware
    if hw.backend != "torch" or hw.num_processes != 1:
        raise ConfigError("rlctl reward-model train runs one process on the torch backend; got "
                          f"hardware.backend={hw.backend}, hardware.num_processes={hw.num_processes}")
    if composed.cfg.model.lora.enabled:
        raise ConfigError("rlctl reward-model train fits the whole model; model.lora.enabled=true "
                          "is not supported here (leave it false)")
    pairs = read_pairs(prefs, "PREFS")
    if eval_prefs:
        train, held = pairs, read_pairs(eval_prefs, "--eval")
    else:
        train, held = hold_out(pairs, rm.eval_frac, int(composed.cfg.seed))
    return composed, rm, train, held


class FitStopped(Interrupted):
    """A fit stopped by a signal after a step, its model saved (``run_dir`` None: before one)."""

    def __init__(self, run_dir: Optional[Path], step: int, steps: int, signum: int):
        super().__init__(run_dir, step, signum)
        self.steps = steps

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        if self.run_dir is None:
            return f"interrupted by {name} before the fit started; nothing was written"
        return (f"interrupted by {name} after step {self.step} of {self.steps}; the model so "
                f"far is saved in {self.run_dir / 'model'} (summary.json: stopped_at_step "
                f"{self.step}; a reward-model fit does not resume)")


def train_reward_model(overrides: Sequence[str], prefs: str,
                       eval_prefs: Optional[str] = None) -> Path:
    """Fit a reward model; its run directory (the model in ``model/``). Raises FitStopped."""
    stop = StopFlag()
    with stop.installed():
        run_dir = _train(*_plan(overrides, prefs, eval_prefs), prefs, eval_prefs, stop)
    return run_dir


def _train(composed, rm: RMConfig, train, held, prefs, eval_prefs, stop) -> Path:
    cfg = composed.cfg
    quiet_libraries(cfg.hardware.device, cfg.hardware.num_threads)
    model, tokenizer = load_classifier(backbone_path(**cfg.model), cfg.model.dtype, int(cfg.seed),
                                       cfg.hardware.device)
    if cfg.model.get("disable_dropout", True):   # the fit's train-mode scores = eval mode's
        disable_dropout(model)
    limit = fit_limit(rm, tokenizer, model.config)
    (t_over, t_same), (h_over, h_same) = (pair_counts(tokenizer, x, limit) for x in (train, held))
    note_truncation(limit, f"rm.max_length={'null' if rm.max_length is None else limit}",
                    {"training": (t_over, len(train)), "held-out": (h_over, len(held))})
    counts = dict(check_identical(t_same, h_same, train, held, "--eval" if eval_prefs
                                  else f"rm.eval_frac={rm.eval_frac} of PREFS"),
                  train_pairs=len(train), eval_pairs=len(held),
                  train_pairs_truncated=t_over, eval_pairs_truncated=h_over)
    if stop.requested:
        raise FitStopped(None, 0, rm.steps, stop.signum)
    run_dir = create_run_dir(cfg.run.output_dir, "rm")
    full = OmegaConf.to_container(cfg, resolve=True)
    resolved = dict({k: full[k] for k in SECTIONS}, rm=asdict(rm), data={
        "prefs": str(prefs), "eval": None if eval_prefs is None else str(eval_prefs)})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    (run_dir / "overrides.yaml").write_text(yaml.safe_dump(
        {"overrides": list(composed.overrides)}, sort_keys=False))
    lg = cfg.logger
    sink = build_sinks(run_dir=run_dir, jsonl=lg.jsonl, wandb=lg.wandb, wandb_mode=lg.wandb_mode,
                       project=lg.project, name=run_dir.name, run_config=resolved,
                       console=lg.console, total_steps=rm.steps, console_keys=REWARD_MODEL_KEYS,
                       tensorboard=lg.tensorboard)
    t0, last = time.perf_counter(), {}

    def on_step(step: int, metrics: Dict[str, float]) -> bool:
        metrics = dict(metrics, **{"optim/lr": rm.lr})
        if step == rm.steps or (rm.eval_every and step % rm.eval_every == 0):
            metrics.update(_evaluate(model, tokenizer, held, rm))
        sink.log(metrics, step)
        last.update(metrics, step=step)
        return stop.requested and step < rm.steps

    try:
        torch.manual_seed(int(cfg.seed))
        fit(model, tokenizer, train, rm, int(cfg.seed), on_step)
        stopped = {} if last["step"] == rm.steps else dict(
            stopped_at_step=last["step"], signal=signal.Signals(stop.signum).name)
        final = {} if stopped else _evaluate(model, tokenizer, held, rm)
        last_train = {k.replace("/", "_"): last[k] for k in ("train/loss", "train/accuracy")}
        _save(run_dir, model, tokenizer, sink, dict(
            final, **counts, **stopped, **last_train,
            train_seconds=round(time.perf_counter() - t0, 3)))
        if stopped:
            raise FitStopped(run_dir, last["step"], rm.steps, stop.signum)
    finally:
        sink.close()
    return run_dir


def _save(run_dir: Path, model, tokenizer, sink, summary: Dict) -> None:
    """The model (safetensors + tokenizer) in ``run_dir/model``, then summary.json."""
    model.save_pretrained(run_dir / "model")
    tokenizer.save_pretrained(run_dir / "model")
    summary = dict(summary, model_dir=str(run_dir / "model"))
    write_json_atomic(run_dir / "summary.json", summary)
    sink.summary(summary)


def eval_reward_model(path: str, prefs: str, batch_size: int = 64, device: str = "cpu"
                      ) -> Dict[str, float]:
    """Pairwise accuracy and scores of the reward model (or run) at ``path`` on ``prefs``."""
    p = Path(path).expanduser()
    if (p / "model" / "config.json").is_file():
        p = p / "model"
    if not (p / "config.json").is_file():
        raise UserError(f"'{path}' is not a reward model directory (no config.json; expected "
                        "a sequence-classifier directory or a run directory with model/)")
    pairs = read_pairs(prefs, "PREFS")
    try:     # the loader `rlctl train` scores with: the same checks, the same one-line errors
        rm = RewardModel(p, device=device, key="PATH")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        model = rm.load()
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"cannot load reward model '{path}': {_first_line(exc)}") from None
    over = pair_counts(rm.tokenizer, pairs, rm.limit)[0]
    note_truncation(rm.limit, f"the reward model's {rm.limit}-token limit", {"": (over, len(pairs))})
    r_c, r_r = score_pairs(model, rm.tokenizer, pairs, batch_size)   # [P] each
    return dict(score_stats(r_c, r_r), truncated_pairs=float(over))
