"""A mid-run resume of a task played as episodes ends exactly as the uninterrupted run
(the approach of test_engine_resume.py, in this process): a 3-step run checkpointing
every step; a copy of it with its last checkpoint removed is resumed from step 2 and
redoes step 3. The environment writes its reset seed into the first observation, so the
sample tables show that the seeds of the redone step come from the checkpointed
prompt RNG (rlctl.rollout.episodes.loop:EpisodeSource: rows and seed drawn from it)."""
import json
import shutil
from pathlib import Path

import pytest

SEEDED_ENV = '''"""Count up from a seeded start: the first observation shows the seed's draw."""
import random

from rlctl.envs.environment import EnvTask
from rlctl.types import Example, Step


class SeededCount:
    def reset(self, example, seed):
        self.n = int(example.fields["start"]) + random.Random(seed).randint(0, 5)
        return f"{example.prompt} {self.n} +"

    def step(self, turn):
        self.n += 1
        right = turn.text.split() == [str(self.n)]
        return Step(observation="+", reward=float(right), done=self.n % 3 == 0,
                    info={"success": right})


def make_task(**options):
    rows = [Example(prompt=str(s), fields={"start": s}) for s in range(1, 9)]
    return EnvTask("seeded_count", SeededCount, train=rows[:6], eval=rows[6:])
'''

STEPS = 3
ARGS = [f"trainer.steps={STEPS}", "trainer.checkpoint_every=1", "trainer.eval_every=0",
        "trainer.prompts_per_step=2", "algo.group_size=2", "logger=jsonl", "logger.console=false",
        "logger.samples.every=1", "logger.samples.n=4", "run.save_model=false",
        "task=guess_number", "task.name=ep_seeded_env:make_task", "model.warmup_task=sorting",
        "rollout.max_new_tokens=2", "rollout.episode.max_turns=2", "rollout.episode.max_tokens=12"]


def _metrics(run: Path):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in rows if "step" in r}


def _samples(run: Path):
    return [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeded_env")
    (d / "ep_seeded_env.py").write_text(SEEDED_ENV)
    return d


def test_episodic_resume_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(
        rlctl_app, env_dir, tmp_path):
    full = tmp_path / "full"
    done = rlctl_app("train", *ARGS, f"run.dir={full}", path=[env_dir], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / f"step-{STEPS:08d}")      # as if stopped after step 2
    (cut / "summary.json").unlink()
    done = rlctl_app("train", "--resume", str(cut), path=[env_dir], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr

    uninterrupted, resumed = _metrics(full), _metrics(cut)
    assert sorted(resumed) == sorted(uninterrupted) and STEPS in resumed
    for step in uninterrupted:
        assert resumed[step] == uninterrupted[step], step
    assert "episode/turns_mean" in resumed[STEPS]
    # the episodes of the redone step, turn by turn, with the seeds' draws in their prompts
    assert _samples(cut) == _samples(full)
    by_step = {}
    for row in _samples(full):
        assert row["turns"][0]["role"] == "model" and row["num_turns"] >= 1
        by_step.setdefault(row["step"], []).append(row["prompt"])
    assert sorted(by_step) == list(range(1, STEPS + 1))
    # the seeds move on from step to step (drawn from the sampler, not fixed)
    assert len({tuple(p) for p in by_step.values()}) > 1, by_step
