"""The typed config schema (Hydra's ConfigStore), the groups of ``rlctl/config/conf`` and every
key with its kind. A key's default is in the YAML or here (not both); its type, range or choices
(``knob``) and help (the comment beside it) only here; components take the section they use."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass(frozen=True)
class Range:
    """The values a numeric key may hold (every float key is also finite)."""
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False          # lo itself excluded
    hi_open: bool = False
    why: str = ""                  # appended to the message, e.g. what 0 would mean

    def contains(self, x: float) -> bool:
        return not ((self.lo is not None and (x < self.lo or (self.lo_open and x == self.lo)))
                    or (self.hi is not None and (x > self.hi or (self.hi_open and x == self.hi))))

    def describe(self) -> str:
        lo, hi = (str(int(x)) if float(x).is_integer() else f"{x:g}" for x in (self.lo, self.hi or 0))
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


POSITIVE, NON_NEGATIVE, AT_LEAST_1, UNIT = Range(0, lo_open=True), Range(0), Range(1), Range(0, 1)


def knob(default: Any = MISSING, *, range: Optional[Range] = None, choices: Sequence = (),
         factory: Optional[Callable] = None) -> Any:
    """A schema field with a numeric ``range`` or ``choices`` (``rlctl.config.checks.validate``)."""
    meta = {"range": range, "choices": tuple(choices)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class KLConfig:
    coef: float = knob(range=NON_NEGATIVE)  # beta (initial beta when adaptive); 0: no reference model
    # k1 | k2 | k3 | null (the placement's unbiased default: k1 in_reward, k3 in_loss;
    # rlctl.core.losses explains which divergence each pair follows, and train warns otherwise)
    estimator: Optional[str] = None
    placement: str = knob(choices=("in_loss", "in_reward"))
    target: Optional[float] = knob(None, range=POSITIVE)  # adaptive: target KL per sequence (nats); null: fixed
    # adaptive controller horizon, in sequences summed over ranks (Ziegler et al., TRL):
    # each update moves beta by up to 0.2 * n_seq / horizon
    horizon: int = knob(range=AT_LEAST_1)


@dataclass
class RolloutCorrectionConfig:
    """The sampler/learner mismatch correction (rlctl.core.rollout_correction; docs/math.md, 14)."""
    enabled: bool = False          # weight the policy loss by w = pi_old / pi_engine
    # token | sequence (w = the product over the sequence's tokens)
    level: str = knob("token", choices=("token", "sequence"))
    # truncate: loss * min(w, upper) | mask: loss * w if lower <= w <= upper, else 0 |
    # measure: weight 1, metrics only
    mode: str = knob("truncate", choices=("truncate", "mask", "measure"))
    upper: float = knob(2.0, range=Range(0, lo_open=True, why="a weight cap / bound"))  # truncate's cap; mask's
    lower: float = knob(0.5, range=Range(0, why="0: no lower bound"))  # mask's lower bound
    bypass: bool = False  # pi_engine stands in for pi_old: no old forward, weight 1, ratio pi / pi_engine


@dataclass
class AlgoConfig:
    name: str = MISSING
    advantage: str = MISSING       # registry key in rlctl.core.advantages
    policy_loss: str = MISSING     # registry key in rlctl.core.losses
    group_size: int = knob(range=AT_LEAST_1)  # G completions per prompt
    loss_agg_mode: str = MISSING   # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    # seq-mean-token-sum-norm's constant divisor (Dr. GRPO); null: a row's model-token budget
    # (rollout.max_new_tokens; episodes: max_turns x that, at most episode.max_tokens), never
    # a step's own length (varies by step and rank)
    norm_len: Optional[int] = knob(None, range=AT_LEAST_1)
    clip_eps: float = knob(range=NON_NEGATIVE)
    clip_eps_high: Optional[float] = knob(None, range=NON_NEGATIVE)  # None: same as clip_eps
    # dual clip for A < 0 (> 1), None: off
    clip_ratio_c: Optional[float] = knob(None, range=Range(1, lo_open=True,
                                                         why="dual clip needs a value > 1 (or null)"))
    epochs: int = knob(range=AT_LEAST_1)  # passes over each rollout
    minibatches: int = knob(range=AT_LEAST_1)  # optimizer steps per pass
    std_eps: float = knob(range=Range(0, lo_open=True, why="it keeps the std normaliser away from 0"))
    baseline: str = knob(choices=("none", "batch_mean"))  # reinforce only: none | batch_mean
    whiten_advantages: bool = MISSING
    # critic (PPO): none | shared (value head on the policy) | separate (own backbone)
    critic: str = knob(choices=("none", "shared", "separate"))
    vf_coef: float = knob(range=NON_NEGATIVE)
    value_clip: Optional[float] = knob(None, range=POSITIVE)
    gamma: float = knob(range=UNIT)
    lam: float = knob(range=UNIT)
    critic_warmup_steps: int = knob(range=NON_NEGATIVE)
    # separate critic: policy (null) | reward_model (its backbone, score head as value head)
    critic_init: Optional[str] = None
    # DAPO: drop groups whose rewards are all equal and sample more to refill the batch
    dynamic_sampling: bool = MISSING
    max_sampling_rounds: int = knob(range=AT_LEAST_1)
    overlong_buffer: int = knob(range=NON_NEGATIVE)  # 0: no overlong penalty
    overlong_penalty: float = knob(range=NON_NEGATIVE)
    # entropy bonus: loss -= coef * aggregated entropy (rlctl.core.losses)
    entropy_coef: float = knob(0.0, range=Range(0, why="an entropy bonus; 0: off"))
    mask_truncated: bool = False   # completions with no stop id left out of the loss (DAPO)
    # preference optimisation on pairs (algo=dpo, task=preferences; docs/rlhf.md): a loss of
    # rlctl.core.preference (sigmoid | ipo | simpo) or package.module:function; null: RL
    loss_type: Optional[str] = None
    beta: float = knob(0.1, range=POSITIVE)  # the implicit reward's scale (DPO's beta)
    # conservative DPO: the chosen answer is preferred with probability 1 - label_smoothing
    label_smoothing: float = knob(0.0, range=Range(0, 0.5, hi_open=True))
    simpo_gamma: float = knob(0.0, range=NON_NEGATIVE)  # SimPO's target reward margin
    # the frozen reference's log-probs of every pair computed once at the start, and the
    # reference model then dropped (LoRA: the adapter-off pass run once per pair)
    precompute_ref_logps: bool = False
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class TaskConfig:
    """One schema for every task; a key left None does not apply, a task rejects a non-None key it
    does not take (rlctl.tasks.task.build_task)."""
    name: str = MISSING
    prompt_format: str = "raw"     # raw | chat (prompts through the tokenizer's chat template)
    system_prompt: Optional[str] = None  # chat only: a system message before each prompt
    # seconds per reward batch (a forked worker, killed at the limit); 0 or null: no limit
    reward_timeout_s: Optional[float] = knob(60.0, range=Range(0, why="0 or null: no limit"))
    # zero: an error or timeout scores 0 and is counted | raise: stop, naming the sample
    on_reward_error: str = "zero"
    # prompts over rollout.max_prompt_tokens: skip (counted) | truncate_left | error
    long_prompts: str = "skip"
    # generated tasks: operand digits (arithmetic: operands in [0, 10^num_digits)), digits to sort
    num_digits: Optional[int] = knob(None, range=AT_LEAST_1)
    # sorting: exact | positional | inclusion_order; arithmetic: exact (the final number, 1/0) |
    # strict (the whole answer is the number) | strict_shaped (strict 1, else 0.5 for the right
    # number inside other text, for max not naming the smaller, 0.2 a bare wrong number) | equation, equation_shaped (the same,
    # the whole answer the problem's equation "a + b = c": 0.2 for it with a wrong c) | partial
    # (exact, else 0.5 * digits in place)
    reward: Optional[str] = None
    # preferences: pairs made by this task (sorting) instead of read from task.train_path
    pairs_from: Optional[str] = None
    num_pairs: Optional[int] = knob(None, range=AT_LEAST_1)  # preferences with pairs_from: training pairs
    # preferences: the seeded fraction of task.train_path held out when task.eval_path is null
    eval_frac: Optional[float] = knob(None, range=Range(0, 1, lo_open=True, hi_open=True))
    # held-out prompts, disjoint from the training ones; jsonl: at most this many eval rows
    # (null: all of eval_path, or 10% of train_path held out)
    # guess_number: episodes cycling over every secret
    num_eval: Optional[int] = knob(None, range=NON_NEGATIVE)
    # seed of the prompt generator (train/eval split); jsonl: shuffles the hold-out
    seed: Optional[int] = knob(None, range=NON_NEGATIVE)
    ops: Optional[List[str]] = None  # arithmetic: any of + - * max (max: style=words only)
    style: Optional[str] = None    # arithmetic: symbolic (for the tiny model) | words
    # data tasks (jsonl): a file or a datasets directory (train_path required)
    train_path: Optional[str] = None
    eval_path: Optional[str] = None  # null: hold out num_eval rows of train_path
    # auto (from the file name) | jsonl | json | csv | tsv | parquet | arrow | hf
    format: Optional[str] = None
    prompt_field: Optional[str] = None
    fields: Optional[List[str]] = None  # columns handed to the reward; null: all but the prompt
    reward_fn: Optional[str] = None     # package.module:function | path/file.py:function | math | exact
    # or several: [{fn: mod:f, weight: 1.0, name: f, batched: ...}, ...] -> reward/<name>
    rewards: Optional[List[Any]] = None
    correct_threshold: Optional[float] = None  # eval/exact_match: total reward >= this
    # multi-turn environments (rlctl/envs/: calculator, guess_number, running_sum)
    # calculator: false = the no-tool ablation (calls not parsed; the first turn is the answer)
    use_tools: Optional[bool] = None
    # tag: <call> calc ... </call> | json: <tool_call>{"name": ..., "arguments": ...}</tool_call>
    # | package.module:Class
    tool_parser: Optional[str] = None
    # none (in-process) | subprocess (best effort) | bwrap (bubblewrap namespaces); docs/agents.md
    sandbox: Optional[str] = None
    # per episode; a call past it is taken as the answer
    max_tool_calls: Optional[int] = knob(None, range=AT_LEAST_1)
    # subprocess sandbox: wall limit per call (CPU limit: ceil)
    tool_timeout_s: Optional[float] = knob(None, range=POSITIVE)
    # subprocess sandbox: RLIMIT_AS (and RLIMIT_FSIZE), GB
    tool_memory_gb: Optional[float] = knob(None, range=Range(
        0.05, why="the sandboxed interpreter itself needs ~20 MB"))
    max_number: Optional[int] = knob(None, range=Range(2))  # guess_number: the secret is in 1..max_number
    num_additions: Optional[int] = knob(None, range=Range(1, 12))  # running_sum: answers per episode
    # learned reward models, any task (rlctl/rm/learned.py, docs/rlhf.md): a
    # sequence-classifier dir (one label, safetensors); the task's own rewards then weigh 0
    # (still scored and logged)
    reward_model: Optional[str] = None
    reward_norm: Optional[str] = "none"  # none | running (mean/std whitening, checkpointed)
    # clip the (normalised) score to [-c, c]; null: no clip
    reward_clip: Optional[float] = knob(None, range=POSITIVE)


@dataclass
class LoraConfig:
    """LoRA adapters via peft (rlctl.models.lora); the KL reference is the model, adapter disabled."""
    enabled: bool = False
    r: int = knob(8, range=AT_LEAST_1)  # adapter rank (> 0)
    alpha: int = knob(16, range=POSITIVE)  # scaling: alpha / r
    dropout: float = knob(0.0, range=Range(0, 1, hi_open=True))  # dropout on the adapter input, [0, 1)
    # [all-linear]: every Linear (and GPT-2 Conv1D) layer but the LM head, as peft's; or
    # module names (suffixes), e.g. [q_proj, v_proj] or [c_attn]
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    save_merged: bool = False      # also save base + adapter merged to <run>/model/merged
    # learning rate while LoRA is on (adapters take a larger one); null: trainer.lr
    lr: Optional[float] = knob(5e-4, range=POSITIVE)


@dataclass
class ModelConfig:
    name: str = MISSING            # tiny | hf
    name_or_path: Optional[str] = None
    dtype: str = knob("float32", choices=("float32", "bfloat16"))
    # Embedded tiny model only (ignored by hf); part of its cache key.
    hidden_size: int = knob(128, range=AT_LEAST_1)
    num_layers: int = knob(2, range=AT_LEAST_1)
    num_heads: int = knob(4, range=AT_LEAST_1)
    warmup_steps: int = knob(0, range=NON_NEGATIVE)
    warmup_lr: float = knob(1e-3, range=POSITIVE)
    warmup_task: str = "sorting"   # sorting | arithmetic (other task names: sorting)
    cache_dir: Optional[str] = None
    gradient_checkpointing: bool = False  # recompute activations in the backward (HF checkpointing)
    # every dropout p = 0 in policy, reference and critic (TRL's): old log-probs come from eval
    # mode, so dropout in the update would make pi/pi_old != 1 at theta_old; LoRA's is kept
    disable_dropout: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class HardwareConfig:
    name: str = MISSING
    backend: str = MISSING         # torch | deepspeed | fsdp2
    device: str = knob(choices=("cpu", "cuda"))
    num_threads: int = knob(range=AT_LEAST_1)  # torch intra-op threads per process (1 on small shared CPUs)
    num_processes: int = knob(1, range=AT_LEAST_1)  # data-parallel ranks that `rlctl train` launches itself
    zero_stage: int = knob(0, choices=(0, 1, 2, 3))  # deepspeed: ZeRO stage 0-3
    # bf16, torch backend: autocast, fp32 weights and AdamW state
    precision: str = knob("fp32", choices=("fp32", "bf16"))
    deepspeed_config: Optional[str] = None  # deepspeed: a user JSON merged under rlctl's keys
    cpu_offload: bool = False  # fsdp2: weight shards, gradients and AdamW state in CPU memory
    # seconds a rank waits for the others to join (or answer)
    dist_timeout_s: float = knob(300.0, range=POSITIVE)
    # MiB of weights gathered at once to push to the rollout engines (a bigger tensor goes alone)
    gather_bucket_mb: float = knob(512.0, range=POSITIVE)
    nnodes: int = knob(1, range=AT_LEAST_1)  # rlctl's own launcher across nodes: machines in the job
    # this machine's index, 0 .. nnodes-1 (node 0 hosts the master)
    node_rank: int = knob(0, range=NON_NEGATIVE)
    master_addr: str = "127.0.0.1"  # node 0's address every rank can reach (TCP rendezvous)
    # its free TCP port (also SLURM's when MASTER_PORT is unset)
    master_port: int = knob(29500, range=Range(1, 65535))


@dataclass
class SamplesConfig:
    # steps between sample tables (0: none); also each held-out eval
    every: int = knob(25, range=Range(0, why="0: no sample tables"))
    n: int = knob(8, range=AT_LEAST_1)  # rows per table, whole groups first so a group's spread shows


@dataclass
class LoggerConfig:
    name: str = MISSING            # wandb | jsonl | tensorboard | none (a list: the last one's name)
    jsonl: bool = False            # each logger= option turns on its own sinks; none turns all off
    wandb: bool = False
    tensorboard: bool = False      # TensorBoard event files under <run>/tensorboard/
    wandb_mode: str = knob("offline", choices=("offline", "online", "disabled"))
    project: str = "rlctl"
    console: bool = True
    samples: SamplesConfig = field(default_factory=SamplesConfig)


@dataclass
class EpisodeConfig:
    """Budgets and rules of multi-turn episodes; rollout.max_new_tokens is then per model turn."""
    max_turns: int = knob(4, range=AT_LEAST_1)  # model turns per episode; more: ends as turn_limit
    max_tokens: int = knob(48, range=AT_LEAST_1)  # completion tokens per episode, turns and observations
    max_obs_tokens: int = knob(16, range=AT_LEAST_1)  # one observation's tokens; longer ones are cut
    obs_truncation: str = knob("right", choices=("right", "left"))  # which end of a long observation is cut
    step_timeout_s: float = knob(10.0, range=POSITIVE)  # one environment step; past it: an error observation
    concurrency: int = knob(8, range=AT_LEAST_1)  # environment steps run at once (threads)
    # how turn rewards make the episode's
    turn_reward: str = knob("sum", choices=("last", "sum", "discounted"))
    turn_discount: float = knob(1.0, range=UNIT)  # discounted: turn k weighs turn_discount ** (k - 1)
    kv_reuse: bool = True          # carry each episode's KV cache across turns (false: recompute each turn)


@dataclass
class ServerConfig:
    """rollout.engine=server: the servers and how weights reach them (docs/engines.md)."""
    # running servers (rlctl serve, vLLM, SGLang); []: the learner starts num_local of its own
    urls: List[str] = field(default_factory=list)
    # urls=[]: `rlctl serve` processes the learner starts (and stops) on 127.0.0.1
    num_local: int = knob(range=AT_LEAST_1)
    # how weights are pushed and replies read (rollout/engines/kinds.py)
    kind: str = knob(choices=("rlctl", "vllm", "sglang"))
    # rows per request; the tokens depend on it, not on how many servers there are
    chunk_size: int = knob(range=AT_LEAST_1)
    timeout_s: float = knob(range=POSITIVE)  # one request; past it the server counts as lost
    # http: weights in the request body | disk: through weight_dir (every server reads it)
    weight_sync: str = knob(choices=("http", "disk"))
    weight_dir: Optional[str] = None  # read by every server at one path: disk (rlctl), LoRA (vllm), all (sglang)
    model_dir: Optional[str] = None  # kind=vllm, full weights: the dir `vllm serve` loads (rewritten per push)


@dataclass
class RolloutConfig:
    max_new_tokens: int = knob(range=AT_LEAST_1)  # completion budget T; longer ones are truncated
    temperature: float = knob(range=Range(0, lo_open=True,
                                         why="sampling needs > 0 (eval is greedy already)"))
    # 0: full distribution; > 0 for eval/rollout only (train refuses it)
    top_k: int = knob(0, range=Range(0, why="0: the full distribution"))
    # null: the model's context minus max_new_tokens (task.long_prompts: longer prompts)
    max_prompt_tokens: Optional[int] = knob(None, range=AT_LEAST_1)
    # extra stop ids (ints) or token strings, added to the tokenizer EOS and the model's
    # generation_config.eos_token_id; each is checked against the vocabulary when the model loads
    stop_token_ids: List[Any] = field(default_factory=list)
    # the training sampler's precision (bfloat16: autocast; the learner keeps its own)
    sample_dtype: str = knob("float32", choices=("float32", "bfloat16"))
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)   # multi-turn tasks only
    # who samples: torch (rlctl's sampler, in the learner or its local engine processes:
    # trainer.async_rollout) | server (completions servers: rollout.server; docs/engines.md)
    engine: str = knob(choices=("torch", "server"))
    server: ServerConfig = field(default_factory=ServerConfig)


@dataclass
class AsyncConfig:
    enabled: bool = MISSING        # local engine processes + learner (rlctl/rollout/engines/engine_source.py)
    # a rollout is at most this many learner steps old (0: synchronous)
    max_staleness: int = knob(range=NON_NEGATIVE)
    sync_every: int = knob(range=AT_LEAST_1)  # learner steps between weight syncs to an engine
    # local engine processes beside the learner (at most min(num_actors, max_staleness) work ahead)
    num_actors: int = knob(1, range=AT_LEAST_1)


@dataclass
class TrainerConfig:
    steps: int = knob(range=NON_NEGATIVE)
    prompts_per_step: int = knob(range=AT_LEAST_1)  # B; N = B * algo.group_size sequences per step
    lr: float = knob(range=POSITIVE)
    weight_decay: float = knob(range=NON_NEGATIVE)
    betas: List[float] = knob(factory=lambda: [0.9, 0.999], range=Range(0, 1, hi_open=True))
    warmup_steps: int = knob(0, range=NON_NEGATIVE)  # linear LR warm-up
    max_grad_norm: float = knob(range=Range(0, why="0: no clipping"))
    # sequences per forward/backward; 0: whole minibatch
    micro_batch_size: int = knob(0, range=Range(0, why="0: the whole minibatch"))
    # padded tokens per forward/backward; 0: no token budget
    micro_batch_tokens: int = knob(0, range=Range(0, why="0: no token budget"))
    # the learner's stored activations per forward/backward, MiB, by the dry run's rule:
    # the minibatch splits into as few even micro-batches as fit (one rank: ranks would
    # split unalike); 0: no limit; null: 768 with hardware.device=cpu, else no limit
    activation_mb: Optional[int] = knob(None, range=Range(0, why="0: no limit"))
    share_prompts: bool = True       # one prompt forward per group (rlctl/models/forward.py)
    compile: bool = False            # torch.compile the learner's forward (plain torch backend)
    eval_every: int = knob(range=Range(0, why="0: no held-out evaluation"))
    log_every: int = knob(1, range=AT_LEAST_1)
    # steps between checkpoints of the full training state, written atomically (0: only at
    # the end); `rlctl train --resume RUN_DIR`
    checkpoint_every: int = knob(range=Range(0, why="0: only at the end"))
    keep_checkpoints: int = knob(range=AT_LEAST_1)  # the newest K are kept
    # consecutive non-finite steps (each skipped and counted) before the run stops
    max_bad_steps: int = knob(range=AT_LEAST_1)
    async_rollout: AsyncConfig = field(default_factory=AsyncConfig)


@dataclass
class RunConfig:
    name: str = MISSING
    output_dir: str = MISSING
    save_model: bool = True
    dir: Optional[str] = None      # this exact run directory (instead of output_dir/<time>-<name>)


@dataclass
class RLConfig:
    defaults: List[Any] = field(default_factory=list)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    seed: int = knob(0, range=Range(0, 2 ** 31, hi_open=True))


GROUPS = ("algo", "task", "model", "hardware", "logger")
CONF_DIR = Path(__file__).parent / "conf"     # config.yaml and a folder of options per group


def group_options(group: str) -> List[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def register_schemas() -> None:
    """Register the schema (first in ``config.yaml``'s defaults: group files merge onto it)."""
    ConfigStore.instance().store(name="rlctl_schema", node=RLConfig)


@dataclass(frozen=True)
class FieldSpec:
    key: str                       # dotted, e.g. "trainer.lr"
    kind: str                      # float | int | bool | str | list | group | any
    optional: bool
    item: str = "any"              # a list's item kind
    range: Optional[Range] = None  # a numeric key's (or list item's) valid values
    choices: tuple = ()            # the valid values of a key with a fixed set


def _kind(tp) -> str:
    if dataclasses.is_dataclass(tp):
        return "group"
    names = {float: "float", int: "int", bool: "bool", str: "str"}
    return names.get(tp, "list" if getattr(tp, "__origin__", None) in (list, List) else "any")


def schema_fields(cls=None, prefix: str = "") -> List[FieldSpec]:
    """Every key of the schema, depth first, with its kind, range and choices."""
    cls = cls or RLConfig
    hints = typing.get_type_hints(cls)
    out: List[FieldSpec] = []
    for f in dataclasses.fields(cls):
        if f.name == "defaults":
            continue
        tp, args = hints[f.name], getattr(hints[f.name], "__args__", ()) or ()
        optional = getattr(tp, "__origin__", None) is typing.Union and type(None) in args
        if optional:
            tp = next(a for a in args if a is not type(None))
        kind, key = _kind(tp), prefix + f.name
        item = _kind(tp.__args__[0]) if kind == "list" and getattr(tp, "__args__", None) else "any"
        out.append(FieldSpec(key, kind, optional, item, f.metadata.get("range"),
                             f.metadata.get("choices", ())))
        if kind == "group":
            out.extend(schema_fields(tp, key + "."))
    return out
