"""The typed config schema: dataclasses registered in Hydra's ConfigStore, the groups of
``rlctl/conf`` with their options, and the list of every key with its kind.

Config flows one way: YAML in ``rlctl/conf`` -> these typed dataclasses -> constructor
arguments. Defaults for values live in the YAML files; the dataclasses give types and
the set of valid keys, so an unknown key or a wrong type fails at compose time.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class KLConfig:
    coef: float = MISSING          # beta (initial beta when adaptive); 0: no reference model
    # k1 | k2 | k3 | null (the placement's unbiased default: k1 in_reward, k3 in_loss;
    # rlctl.core.kl explains which divergence each pair follows, and train warns otherwise)
    estimator: Optional[str] = None
    placement: str = MISSING       # in_loss | in_reward
    target: Optional[float] = None  # adaptive coefficient: target KL per sequence (nats)
    horizon: int = MISSING         # adaptive controller horizon, in sequences (Ziegler et al.,
                                   # TRL): each update moves beta by up to 0.2 * n_seq / horizon


@dataclass
class RolloutCorrectionConfig:
    """The off-policy correction for sampler/learner mismatch (rlctl.core.rollout_correction)."""
    enabled: bool = False          # weight the policy loss by w = pi_old / pi_engine
    level: str = "token"           # token | sequence (w = the product over the sequence's tokens)
    mode: str = "truncate"         # truncate: min(w, upper) | mask: w in [lower, upper] else 0 | measure: 1
    upper: float = 2.0             # truncate's cap C; mask's upper bound
    lower: float = 0.5             # mask's lower bound
    bypass: bool = False           # pi_engine stands in for pi_old: no old forward, weight 1


@dataclass
class AlgoConfig:
    name: str = MISSING
    advantage: str = MISSING       # registry key in rlctl.core.advantages
    policy_loss: str = MISSING     # registry key in rlctl.core.losses
    group_size: int = MISSING      # G completions per prompt
    loss_agg_mode: str = MISSING   # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    norm_len: Optional[int] = None  # constant normaliser for seq-mean-token-sum-norm (conf: rollout.max_new_tokens)
    clip_eps: float = MISSING
    clip_eps_high: Optional[float] = None  # None: same as clip_eps
    clip_ratio_c: Optional[float] = None   # dual clip for A < 0 (> 1), None: off
    epochs: int = MISSING          # passes over each rollout
    minibatches: int = MISSING     # optimizer steps per pass
    std_eps: float = MISSING
    baseline: str = MISSING        # reinforce only: none | batch_mean
    whiten_advantages: bool = MISSING
    # critic (PPO): none | shared (value head on the policy) | separate (own backbone)
    critic: str = MISSING
    vf_coef: float = MISSING
    value_clip: Optional[float] = None
    gamma: float = MISSING
    lam: float = MISSING
    critic_warmup_steps: int = MISSING
    critic_init: Optional[str] = None  # separate critic: policy (null) | reward_model (its backbone + score head)
    # DAPO: drop groups whose rewards are all equal and sample more to refill the batch
    dynamic_sampling: bool = MISSING
    max_sampling_rounds: int = MISSING
    overlong_buffer: int = MISSING     # 0: no overlong penalty
    overlong_penalty: float = MISSING
    entropy_coef: float = 0.0      # entropy bonus: loss -= coef * aggregated entropy (rlctl.core.terms)
    mask_truncated: bool = False   # completions with no stop id left out of the loss (DAPO)
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class TaskConfig:
    """One schema for every task; each conf/task/*.yaml sets the keys its task takes
    (the first four in all of them). A key left None does not apply to the chosen task;
    a task rejects a non-None key it does not take (rlctl.tasks.base.build_task)."""
    name: str = MISSING
    prompt_format: str = MISSING   # raw | chat (prompts through the tokenizer's chat template)
    system_prompt: Optional[str] = None  # chat only
    reward_timeout_s: Optional[float] = MISSING  # per reward batch; 0 or null: no limit
    on_reward_error: str = MISSING  # zero (score 0 and count) | raise
    long_prompts: str = "skip"     # over rollout.max_prompt_tokens: skip | truncate_left | error
    # generated tasks (sorting, arithmetic)
    num_digits: Optional[int] = None
    reward: Optional[str] = None   # sorting: exact | positional | inclusion_order; arithmetic: exact | partial
    num_eval: Optional[int] = None  # held-out prompts
    seed: Optional[int] = None     # seed of the prompt generator (train/eval split)
    ops: Optional[List[str]] = None  # arithmetic: + - *
    style: Optional[str] = None    # arithmetic: symbolic | words
    # data tasks (jsonl)
    train_path: Optional[str] = None
    eval_path: Optional[str] = None
    format: Optional[str] = None   # auto | jsonl | json | csv | tsv | parquet | arrow | hf
    prompt_field: Optional[str] = None
    fields: Optional[List[str]] = None  # columns handed to the reward; null: all but the prompt
    reward_fn: Optional[str] = None     # package.module:function | path/file.py:function | math | exact
    rewards: Optional[List[Any]] = None  # [{fn: ..., weight: 1.0, name: ..., batched: ...}]
    correct_threshold: Optional[float] = None  # eval/exact_match: total reward >= this
    # multi-turn environments (rlctl/envs/: calculator, guess_number, running_sum)
    use_tools: Optional[bool] = None       # calculator: false = the no-tool ablation (calls not parsed)
    tool_parser: Optional[str] = None      # tag | json | package.module:Class
    sandbox: Optional[str] = None          # none (in-process) | subprocess (best-effort isolation)
    max_tool_calls: Optional[int] = None   # per episode; a call past it is taken as the answer
    tool_timeout_s: Optional[float] = None  # subprocess sandbox: wall limit per call (CPU limit: ceil)
    tool_memory_gb: Optional[float] = None  # subprocess sandbox: RLIMIT_AS (and RLIMIT_FSIZE), GB
    max_number: Optional[int] = None       # guess_number: the secret is in 1..max_number
    num_additions: Optional[int] = None    # running_sum: answers per episode
    # learned reward models, any task (rlctl/reward_models/learned.py)
    reward_model: Optional[str] = None  # sequence-classifier dir; the task's own rewards then weigh 0 (still logged)
    reward_norm: Optional[str] = None   # none | running (mean/std whitening, checkpointed)
    reward_clip: Optional[float] = None  # clip the (normalised) score to [-c, c]; null: no clip


@dataclass
class LoraConfig:
    """LoRA adapters via peft (rlctl.models.lora); values in conf/model/*.yaml."""
    enabled: bool = MISSING
    r: int = MISSING               # adapter rank (> 0)
    alpha: int = MISSING           # scaling: alpha / r
    dropout: float = MISSING       # dropout on the adapter input, [0, 1)
    target_modules: List[str] = MISSING  # [all-linear] or names (suffixes) of Linear modules
    save_merged: bool = MISSING    # also save base + adapter merged to <run>/model/merged
    lr: Optional[float] = None     # learning rate while LoRA is on (larger); null: trainer.lr


@dataclass
class ModelConfig:
    name: str = MISSING            # tiny | hf
    name_or_path: Optional[str] = None
    dtype: str = MISSING           # float32 | bfloat16
    # Embedded tiny model only (ignored by hf); part of its cache key.
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    warmup_steps: int = 0
    warmup_lr: float = 1e-3
    warmup_task: str = "sorting"   # sorting | arithmetic (other task names: sorting)
    cache_dir: Optional[str] = None
    gradient_checkpointing: bool = False  # recompute activations in the backward (HF checkpointing)
    disable_dropout: bool = True   # every dropout p = 0 (policy, reference, critic); LoRA's kept
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class HardwareConfig:
    name: str = MISSING
    backend: str = MISSING         # torch | deepspeed
    device: str = MISSING          # cpu | cuda
    num_threads: int = MISSING     # torch intra-op threads per process (1 on small shared CPUs)
    num_processes: int = MISSING   # data-parallel ranks that `rlctl train` launches itself
    zero_stage: int = MISSING      # deepspeed: ZeRO stage 0-3
    precision: str = MISSING       # fp32 | bf16 (torch: autocast, fp32 weights and AdamW state)
    deepspeed_config: Optional[str] = None  # deepspeed: a user JSON merged under rlctl's keys
    dist_timeout_s: float = 300.0  # seconds a rank waits for the others to join (or answer)
    nnodes: int = 1                # rlctl's own launcher across nodes: machines in the job
    node_rank: int = 0             # this machine's index, 0 .. nnodes-1 (node 0 hosts the master)
    master_addr: str = "127.0.0.1"  # node 0's address every rank can reach (TCP rendezvous)
    master_port: int = 29500       # its free TCP port (also SLURM's when MASTER_PORT is unset)


@dataclass
class SamplesConfig:
    every: int = 25                # steps between sample tables (0: none); also each held-out eval
    n: int = 8                     # rows per table, whole groups first so a group's spread shows


@dataclass
class LoggerConfig:
    name: str = MISSING            # wandb | jsonl | tensorboard | none (a list: the last one's name)
    jsonl: bool = False            # each logger= option turns on its own sinks; none turns all off
    wandb: bool = False
    tensorboard: bool = False      # TensorBoard event files under <run>/tensorboard/
    wandb_mode: str = "offline"    # offline | online | disabled
    project: str = "rlctl"
    console: bool = True
    samples: SamplesConfig = field(default_factory=SamplesConfig)


@dataclass
class EpisodeConfig:
    """Budgets and rules of multi-turn episodes (tasks played in an environment)."""
    max_turns: int = 4             # model turns per episode; more: ends as turn_limit
    max_tokens: int = 48           # completion tokens per episode, turns and observations
    max_obs_tokens: int = 16       # one observation's tokens; longer ones are cut
    obs_truncation: str = "right"  # which end of a long observation is cut: right | left
    step_timeout_s: float = 10.0   # one environment step; past it: an error observation
    concurrency: int = 8           # environment steps run at once (threads)
    turn_reward: str = "sum"       # how turn rewards make the episode's: last | sum | discounted
    turn_discount: float = 1.0     # discounted: turn k weighs turn_discount ** (k - 1)
    kv_reuse: bool = True          # carry each episode's KV cache across turns (false: recompute each turn)


@dataclass
class ServerConfig:
    """rollout.engine=server: where the servers are and how weights reach them."""
    urls: List[str] = field(default_factory=list)   # []: the learner starts num_local of its own
    num_local: int = MISSING       # `rlctl serve` processes the learner starts on 127.0.0.1
    kind: str = MISSING            # rlctl | vllm | sglang: how weights are pushed, replies read
    chunk_size: int = MISSING      # rows per request (the tokens depend on it)
    timeout_s: float = MISSING     # one request; past it the server counts as lost
    weight_sync: str = MISSING     # http | disk (through weight_dir)
    weight_dir: Optional[str] = None   # disk sync (rlctl); vllm: LoRA adapters; sglang: all weights
    model_dir: Optional[str] = None    # vllm, full weights: the directory `vllm serve` loads


@dataclass
class RolloutConfig:
    max_new_tokens: int = MISSING
    temperature: float = MISSING
    top_k: int = 0                 # 0: full distribution; > 0 for eval/rollout only (train refuses it)
    max_prompt_tokens: Optional[int] = None  # null: the model's context minus max_new_tokens
    # extra stop ids (ints) or token strings, added to the tokenizer EOS and the model's
    # generation_config.eos_token_id; each is checked against the vocabulary when the model loads
    stop_token_ids: List[Any] = field(default_factory=list)
    sample_dtype: str = "float32"  # the training sampler's precision: float32 | bfloat16 (autocast)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)   # multi-turn tasks only
    engine: str = MISSING          # torch (the learner's own sampler) | server
    server: ServerConfig = field(default_factory=ServerConfig)


@dataclass
class AsyncConfig:
    enabled: bool = MISSING        # local engine processes + learner (rlctl/rollout/local_engine.py)
    max_staleness: int = MISSING   # a rollout is at most this many learner steps old (0: synchronous)
    sync_every: int = MISSING      # learner steps between weight syncs to an engine
    num_actors: int = 1            # rollout actor processes beside the learner (>= 1)


@dataclass
class TrainerConfig:
    steps: int = MISSING
    prompts_per_step: int = MISSING  # B
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0            # linear LR warm-up
    max_grad_norm: float = MISSING
    micro_batch_size: int = 0        # sequences per forward/backward; 0: whole minibatch
    micro_batch_tokens: int = 0      # padded tokens per forward/backward; 0: no token budget
    share_prompts: bool = True       # one prompt forward per group (rlctl/learner/forward.py)
    compile: bool = False            # torch.compile the learner's forward (plain torch backend)
    eval_every: int = MISSING
    log_every: int = 1
    checkpoint_every: int = MISSING  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = MISSING  # the newest K are kept
    max_bad_steps: int = MISSING     # consecutive non-finite steps before the run stops
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
    seed: int = 0


GROUPS = ("algo", "task", "model", "hardware", "logger")
CONF_DIR = Path(__file__).parent / "conf"     # config.yaml and a folder of options per group


def group_options(group: str) -> List[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def register_schemas() -> None:
    """Register the schema; ``config.yaml`` lists it first in its defaults, so every
    group file merged on top is validated against the typed node it lands in."""
    ConfigStore.instance().store(name="rlctl_schema", node=RLConfig)


# -- every key with its kind (for messages and the range checks) -------------------------

@dataclass(frozen=True)
class FieldSpec:
    key: str                       # dotted, e.g. "trainer.lr"
    kind: str                      # float | int | bool | str | list | group | any
    optional: bool
    item: str = "any"              # a list's item kind


def _kind(tp) -> str:
    if dataclasses.is_dataclass(tp):
        return "group"
    names = {float: "float", int: "int", bool: "bool", str: "str"}
    return names.get(tp, "list" if getattr(tp, "__origin__", None) in (list, List) else "any")


def schema_fields(cls=None, prefix: str = "") -> List[FieldSpec]:
    """Every key of the schema, depth first (groups and their keys), with its kind."""
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
        out.append(FieldSpec(key, kind, optional, item))
        if kind == "group":
            out.extend(schema_fields(tp, key + "."))
    return out
