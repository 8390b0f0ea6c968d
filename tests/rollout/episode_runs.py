"""Shared by the tests of episodic runs beyond one plain process (async actors, several
ranks, LoRA): a user environment of per-turn rewards written to a file and loaded by
path, the overrides of a short run on the shipped tiny model, and a Trainer built from
them as ``rlctl train`` builds it (rlctl/train/run.py), minus the run directory.

The environment's first observation depends on the episode's seed (``start + seed % 5``),
so a rollout played with another seed than the learner drew differs."""
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.config.schema import EpisodeConfig, RolloutConfig
from rlctl.train.trainer import Trainer
from rlctl.train.build import model_from_config, prepare_task, task_from_config
from rlctl.train.sources import build_source
from rlctl.sinks import NullSink
from rlctl.types import MODEL

def player_settings(group_size, max_new_tokens, temperature, top_k=0, **episode):
    """(rollout section, group size) for an ``EpisodePlayer``: the schema's defaults for
    every ``rollout.episode`` key not given."""
    return RolloutConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         episode=EpisodeConfig(**episode)), group_size


COUNT_UP = '''"""Count up from the first observation's number; reward 1 per right turn."""
from rlctl.envs.environment import EnvTask
from rlctl.types import Example, Step


class CountUp:
    def reset(self, example, seed):
        self.n = int(example.fields["start"]) + seed % 5
        return " ".join(str(self.n)) + " +"

    def step(self, turn):
        self.n += 1
        right = turn.text.split() == list(str(self.n))
        return Step(observation=" ".join(str(self.n)) + " +", reward=float(right),
                    done=self.n % 4 == 0, info={"success": right, "tool_calls": 1})


def make_task(**options):        # the task config's other keys do not apply here
    rows = [Example(prompt="", fields={"start": s}) for s in range(1, 9)]
    return EnvTask("count_up", CountUp, train=rows[:6], eval=rows[6:])
'''


def env_file(tmp_path: Path) -> str:
    """The environment written under ``tmp_path``; its task spec (file path:make_task)."""
    path = Path(tmp_path) / "count_up_env.py"
    path.write_text(COUNT_UP)
    return f"{path}:make_task"


def run_args(spec: str):
    """A short run: 2 rows x 2 episodes a step, up to 3 turns of 3 tokens."""
    return ["task=guess_number", f"task.name={spec}", "model.warmup_task=sorting",
            "trainer.prompts_per_step=2", "algo.group_size=2", "trainer.eval_every=0",
            "trainer.lr=1e-3", "rollout.max_new_tokens=3", "rollout.episode.max_turns=3",
            "rollout.episode.max_tokens=20"]


def build_trainer(overrides, backend=None) -> Trainer:
    """The Trainer of ``rlctl train OVERRIDES`` (its model, task and rollout source)."""
    cfg = compose(list(overrides)).cfg
    OmegaConf.resolve(cfg)
    built = task_from_config(cfg)
    model, critic, tok, ref = model_from_config(cfg)
    task = prepare_task(cfg, tok, model, built, quiet=True)
    torch.manual_seed(cfg.seed * 1000 + (backend.rank if backend is not None else 0))
    source = build_source(cfg, model, tok, task, backend)
    return Trainer.from_config(cfg, model, tok, task, NullSink(), source=source, critic=critic,
                               ref_model=ref, backend=backend)


def model_turn_gaps(batch, learner):
    """(row, span, max |learner - behaviour| log-prob) of every model turn of a played
    batch, each episode checked to have at least two turns (so later turns are compared)."""
    out = []
    for i, e in enumerate(batch.episodes.records):
        assert e.turns >= 2
        for s in e.spans:
            if s.role == MODEL:
                gap = (learner[i, s.start:s.end] - batch.logprobs.old[i, s.start:s.end]).abs().max()
                out.append((i, s, float(gap)))
    return out
