"""What a composed config may hold beyond its types, checked with no torch; one-line errors."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from rlctl.errors import ConfigError, one_line
from rlctl.config.schema import (AlgoConfig, FieldSpec, HardwareConfig, Range, RolloutConfig, ServerConfig,
                                 TrainerConfig, schema_fields)

# Ranges and choices are written once, in the schema (``knob``); every float is also finite.
# A new numeric key needs a range or a place in FREE_NUMBERS (a test checks).
RANGES: Dict[str, Range] = {s.key: s.range for s in schema_fields() if s.range is not None}
CHOICES: Dict[str, tuple] = {s.key: s.choices for s in schema_fields() if s.choices}
# any finite number, or checked elsewhere (zero_stage: one of 0-3, a choice)
FREE_NUMBERS = ("task.correct_threshold", "hardware.zero_stage")
CRITIC_KEYS = {"algo.vf_coef", "algo.value_clip", "algo.critic_warmup_steps", "algo.lam"}
EXAMPLES = {"float": "0.1", "int": "1", "bool": "true", "str": "name", "any": "1"}


def example_value(spec: FieldSpec) -> str:
    """A value of the right type (and inside the key's range) to show in a message."""
    if spec.kind == "list":
        return {"float": "[0.9,0.999]", "str": "[a,b]"}.get(spec.item, "[...]")
    if spec.kind == "group":
        return "{...}"
    candidates = {"float": (0.1, 0.5, 1.0, 3.0), "int": (1, 0, 4)}.get(spec.kind, ())
    return next((repr(x) for x in candidates if spec.range is None or spec.range.contains(x)),
                EXAMPLES[spec.kind])


def range_problem(spec: FieldSpec, value: Any) -> Optional[str]:
    """What is wrong with one value of a numeric key ("must be ..."), or None."""
    kind = spec.item if spec.kind == "list" else spec.kind
    if value is None or kind not in ("float", "int") or isinstance(value, bool):
        return None
    rng = RANGES.get(spec.key)
    finite = math.isfinite(value)
    if finite and (rng is None or rng.contains(value)):
        return None
    what = rng.describe() if rng is not None else "a number"
    tail = " and finite" if kind == "float" and rng is not None else (" (finite)" if kind == "float" else "")
    why = f"; {rng.why}" if rng is not None and rng.why and finite else ""
    return f"must be {what}{tail}{why}"


def value_problems(section, prefix: str) -> List[Tuple[int, str]]:
    """(rank, one line) of each key under ``prefix`` ("algo.", or "" for the top-level values),
    ``section`` holding them: outside its range (rank 0; 1 for a key that copies another by
    interpolation, so a bad source is named before its copy) or not one of its choices (2)."""
    out = []
    for spec in schema_fields():
        rel = spec.key[len(prefix):]
        if not spec.key.startswith(prefix) or (not prefix and "." in rel):
            continue
        value = OmegaConf.select(section, rel)
        if spec.key in CHOICES and value not in CHOICES[spec.key]:
            out.append((2, f"invalid {spec.key} '{value}'; valid: {', '.join(map(str, CHOICES[spec.key]))}"))
        if spec.kind not in ("float", "int", "list"):
            continue
        parent, _, leaf = rel.rpartition(".")
        copied = OmegaConf.is_interpolation(OmegaConf.select(section, parent) if parent else section, leaf)
        items = list(value) if spec.kind == "list" and value is not None else [value]
        problem = next(filter(None, (range_problem(spec, item) for item in items)), None)
        if problem:
            shown = list(value) if spec.kind == "list" else value
            out.append((int(copied), f"invalid {spec.key} '{shown}'; {problem}"))
    return out


def read_deepspeed_config(path: str) -> Dict:
    """The user's DeepSpeed JSON (hardware.deepspeed_config) as a dict; ConfigError if not."""
    where = f"hardware.deepspeed_config '{path}'"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"hardware.deepspeed_config: no such file '{path}'") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text; it must be a DeepSpeed JSON config") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column "
                          f"{exc.colno}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object ({{\"key\": value, ...}}), "
                          f"got a {type(data).__name__}")
    return data


def _check_cuda(hw: HardwareConfig) -> None:
    if hw.device != "cuda":
        return
    import torch  # only to ask for a GPU: validation of a CPU config imports no torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"hardware.device=cuda (hardware={hw.name}) needs a CUDA GPU, and {why}; "
                          "use hardware=cpu (or hardware.device=cpu)")


def _check_fsdp2(hw: HardwareConfig, tr: TrainerConfig, merged: bool) -> None:
    """What FSDP2 (sharded weights) cannot do here, each one line."""
    if tr.micro_batch_tokens > 0 and hw.num_processes > 1:
        raise ConfigError("trainer.micro_batch_tokens with hardware=fsdp2 on several ranks: each "
                          "rank would run its own number of sharded forwards (collectives) and "
                          "hang; use trainer.micro_batch_size, or hardware=deepspeed")
    if merged:
        raise ConfigError("model.lora.save_merged=true with hardware=fsdp2: the adapter is saved "
                          "from the gathered weights, the merge needs the module whole; set "
                          "model.lora.save_merged=false and merge the saved adapter afterwards")


def _check_hardware(hw: HardwareConfig, tr: TrainerConfig, engine: str, merged: bool) -> None:
    if tr.prompts_per_step % hw.num_processes:
        raise ConfigError(f"hardware.num_processes={hw.num_processes} must be >= 1 and divide "
                          f"trainer.prompts_per_step={tr.prompts_per_step} (each rank "
                          "samples whole prompt groups)")
    if hw.deepspeed_config is not None:
        read_deepspeed_config(hw.deepspeed_config)
    _check_cuda(hw)
    if tr.compile and hw.backend != "torch":
        raise ConfigError("trainer.compile=true needs hardware.backend=torch (DeepSpeed and FSDP2 "
                          f"wrap the model; got hardware.backend={hw.backend})")
    if hw.cpu_offload and hw.backend != "fsdp2":
        raise ConfigError(f"hardware.cpu_offload=true needs hardware=fsdp2 (got hardware.backend="
                          f"{hw.backend}; DeepSpeed offload goes in hardware.deepspeed_config)")
    if hw.backend == "fsdp2":
        _check_fsdp2(hw, tr, merged)
    if tr.async_rollout.enabled and hw.nnodes > 1 and engine == "torch":
        raise ConfigError("trainer.async_rollout runs its actors beside the learner, on one machine "
                          f"(got hardware.nnodes={hw.nnodes}); rollout on other machines is "
                          "rollout.engine=server rollout.server.urls=[http://NODE:PORT,...] with "
                          "`rlctl serve` on those machines (docs/engines.md)")
    if tr.async_rollout.enabled and hw.num_processes > 1:
        raise ConfigError("trainer.async_rollout.enabled=true runs one learner process; it needs "
                          f"hardware.num_processes=1 (got {hw.num_processes})")


def _check_algo(a: AlgoConfig, prompts_per_step: int, temperature: float) -> None:
    rc = a.rollout_correction
    if rc.mode == "mask" and rc.lower > rc.upper:
        raise ConfigError(f"algo.rollout_correction.lower={rc.lower} must be <= "
                          f"algo.rollout_correction.upper={rc.upper} (mask keeps weights in [lower, upper])")
    if a.kl.target is not None and a.kl.coef <= 0:
        raise ConfigError("an adaptive KL (algo.kl.target) needs algo.kl.coef > 0 and a target > 0")
    if a.loss_type is not None and (a.group_size != 2 or a.dynamic_sampling or a.critic != "none"):
        raise ConfigError(f"algo.loss_type={a.loss_type} trains on pairs (chosen, rejected): it "
                          "needs algo.group_size=2, algo.dynamic_sampling=false, algo.critic=none")
    if a.loss_type is not None:     # a preference loss: its own log-ratio, both answers whole
        for key, bad, valid in (("algo.mask_truncated", a.mask_truncated, "false"),
                                ("algo.kl.coef", a.kl.coef > 0, "0"),
                                ("algo.entropy_coef", a.entropy_coef > 0, "0"),
                                ("rollout.temperature", temperature != 1, "1.0")):
            if bad:
                raise ConfigError(f"algo.loss_type={a.loss_type} needs {key}={valid} (a "
                                  "preference loss scores both answers whole, untempered, "
                                  "beta its only KL scale)")
    if a.precompute_ref_logps and a.loss_type is None:
        raise ConfigError("algo.precompute_ref_logps=true caches a preference loss's reference "
                          "log-probs; it needs algo.loss_type (algo=dpo)")
    n = prompts_per_step * a.group_size
    if n % a.minibatches and not a.dynamic_sampling:
        raise ConfigError(f"algo.minibatches={a.minibatches} must divide the "
                          f"{n} sequences per step (trainer.prompts_per_step * algo.group_size)")
    if a.dynamic_sampling and a.minibatches > a.group_size:   # a rank keeps >= 1 group
        raise ConfigError(f"algo.minibatches={a.minibatches} with algo.dynamic_sampling=true must be "
                          f"<= algo.group_size={a.group_size} (a step may keep a single group)")


def _check_engine(rollout: RolloutConfig, hw: HardwareConfig, lora: bool) -> None:
    """rollout.engine=server: one learner process, the server keys agree."""
    sv = rollout.server
    if rollout.engine != "server":
        return
    if hw.num_processes > 1 or hw.nnodes > 1:
        raise ConfigError("rollout.engine=server runs one learner process (hardware.num_processes=1, "
                          "hardware.nnodes=1); the servers are the other machines")
    if rollout.sample_dtype != "float32":
        raise ConfigError("rollout.sample_dtype applies to rollout.engine=torch; a server samples "
                          "in its own precision (start it with model.dtype=bfloat16)")
    if sv.weight_sync == "disk" and not sv.weight_dir:
        raise ConfigError("rollout.server.weight_sync=disk needs rollout.server.weight_dir "
                          "(a directory every server can read)")
    urls = list(sv.urls or [])
    if not urls and sv.kind != "rlctl":
        raise ConfigError(f"rollout.server.kind={sv.kind} needs rollout.server.urls (the running "
                          "servers); with urls=[] the run starts `rlctl serve` processes (kind rlctl)")
    bad = next((u for u in urls if not isinstance(u, str) or not u.startswith(("http://", "https://"))), None)
    if bad is not None:
        raise ConfigError(f"rollout.server.urls holds {bad!r}; each is http://HOST:PORT")
    _check_kind_dirs(sv, lora)


def _check_kind_dirs(sv: ServerConfig, lora: bool) -> None:
    """vllm/sglang servers read each push from files at a shared path: it must be named."""
    if sv.kind == "rlctl":
        return
    if sv.weight_sync == "disk":
        raise ConfigError(f"rollout.server.weight_sync=disk is for kind=rlctl; kind={sv.kind} always "
                          "pushes through shared files: set rollout.server.weight_dir"
                          + ("" if sv.kind == "sglang" else " (LoRA) or model_dir (full weights)")
                          + " and keep weight_sync=http")
    if sv.kind == "vllm" and not lora and not sv.model_dir:
        raise ConfigError("rollout.server.kind=vllm with full weights needs rollout.server.model_dir "
                          "(the directory `vllm serve` loads, at the same path here); or model.lora.enabled=true")
    if sv.kind == "vllm" and not lora and not Path(str(sv.model_dir)).is_dir():
        raise ConfigError(f"rollout.server.model_dir={sv.model_dir} is not a directory here; it is the "
                          "directory `vllm serve` loads, at the same path on this machine")
    if not sv.weight_dir and (sv.kind == "sglang" or lora):
        raise ConfigError(f"rollout.server.kind={sv.kind} needs rollout.server.weight_dir (a directory "
                          "the servers read at the same path) to push "
                          + ("the LoRA adapter" if lora else "weights"))


def validate(cfg: DictConfig, overrides: Sequence[str] = (), algo: str = "") -> None:
    """Every check above, each given the sections it reads (the shell's ``overrides`` may not
    set a critic key without a critic); those needing registries or the built task:
    ``rlctl.train.preflight``."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as exc:  # noqa: BLE001
        msg = one_line(exc)
        key = re.search(r"full_key: ([\w.]+)", msg)
        if "Missing mandatory value" in msg and key:
            raise ConfigError(f"missing value for '{key.group(1)}'; set it with {key.group(1)}=...") from None
        raise ConfigError(msg) from None
    top = [s for s in schema_fields() if "." not in s.key]
    sections = [(s.key + ".", cfg[s.key]) for s in top if s.kind == "group"]
    sections.append(("", OmegaConf.masked_copy(cfg, [s.key for s in top if s.kind != "group"])))
    problems = [p for prefix, section in sections for p in value_problems(section, prefix)]
    if problems:
        raise ConfigError(min(problems, key=lambda p: p[0])[1])
    tr, hw = cfg.trainer, cfg.hardware
    _check_engine(cfg.rollout, hw, bool(cfg.model.lora.enabled))
    _check_algo(cfg.algo, tr.prompts_per_step, cfg.rollout.temperature)
    if cfg.task.get("num_eval") == 0 and tr.eval_every > 0:
        raise ConfigError("task.num_eval=0 leaves no held-out set to evaluate every "
                          f"trainer.eval_every={tr.eval_every} steps; set "
                          "trainer.eval_every=0 (no evaluation) or task.num_eval >= 1")
    if cfg.model.name == "hf" and not cfg.model.name_or_path:
        raise ConfigError("model=hf needs model.name_or_path=PATH_OR_HUB_ID")
    _check_hardware(hw, tr, cfg.rollout.engine,
                    bool(cfg.model.lora.enabled and cfg.model.lora.save_merged))
    sharded = hw.backend == "fsdp2" or (hw.backend == "deepspeed" and hw.zero_stage == 3)
    if sharded and hw.num_processes > 1 and cfg.algo.dynamic_sampling and tr.micro_batch_size > 0:
        raise ConfigError("algo.dynamic_sampling=true with trainer.micro_batch_size>0 on several "
                          f"ranks of sharded weights (hardware.backend={hw.backend}): ranks keep "
                          "different numbers of groups, so they would run different numbers of "
                          "sharded forwards (collectives) and hang; set trainer.micro_batch_size=0")
    given = [o.split("=", 1)[0] for o in overrides if o.split("=", 1)[0] in CRITIC_KEYS]
    if given and cfg.algo.critic == "none":
        raise ConfigError(f"{given[0]} is a critic setting, and algo={algo} has no "
                          "critic; use an algorithm with one (algo=ppo) or set algo.critic=shared "
                          "with algo.advantage=gae")
    weight_dir = cfg.rollout.server.weight_dir   # a directory (made at the first push) or nothing yet
    if weight_dir and Path(str(weight_dir)).exists() and not Path(str(weight_dir)).is_dir():
        raise ConfigError(f"rollout.server.weight_dir={weight_dir} is a file; it must be a "
                          "directory every server reads (one that does not exist yet is made)")


def check_overlong(algo, rollout, episodic: bool) -> None:
    """DAPO's overlong ramp lies inside the length budget: ``rollout.max_new_tokens``, or
    ``rollout.episode.max_tokens`` for a task played as episodes (known once the task is built)."""
    key, budget = (("rollout.episode.max_tokens", rollout.episode.max_tokens) if episodic
                   else ("rollout.max_new_tokens", rollout.max_new_tokens))
    if algo.overlong_buffer > budget:
        raise ConfigError(f"algo.overlong_buffer={algo.overlong_buffer} must be <= {key}={budget} (the "
                          "penalty ramps over the last overlong_buffer tokens of that length budget)")
