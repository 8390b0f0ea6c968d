"""reward/<name> (each named reward's mean since the last step) over several ranks: the
mean over every rank's scored samples, not rank 0's alone (the scorer's means were added
after reduce_metrics, so on 2 ranks they were rank 0's half of the batch).

Two gloo ranks as subprocesses scoring different numbers of sorting completions with a
real RewardScorer, pooled by the trainer's named_reward_metrics + reduce_metrics, against
a float64 mean over all of them; one rank whose every sample fails (no names at all) still
sends the same metrics (no hang) and counts 0 for them, as a failed sample counts on one
rank. And a real 2-process `rlctl train`: its logged reward/positional (the training
reward of the default sorting task) equals reward/mean, which the step's batch pools over
both ranks on its own path (rollout_metrics: the rewards tensor)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gloo_ranks import run_two_ranks

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
# (prompt digits, completion) per rank: 3 samples on rank 0, 5 on rank 1
ROWS = {0: [([3, 1, 2], "1 2 3"), ([5, 4, 9], "4 9 5"), ([7, 7, 1], "7")],
        1: [([2, 8, 6], "2 6 8"), ([1, 1, 1], "1 1 1"), ([9, 3, 0], "0 9 3"),
            ([4, 6, 5], "6 5 4 4"), ([0, 2, 2], "")]}


def _examples(rows):
    from rlctl.tasks.sorting import SortingTask
    from rlctl.types import Example

    task = SortingTask(num_digits=3, seed=0)
    return task, [Example(prompt=" ".join(map(str, d)) + " =", fields={"digits": d}) for d, _ in rows]


FAIL_RANKS = [-1, 1]
FAIL_IDS = ["both-score", "rank-1-fails-every-sample"]


def _rank_worker(out_dir: str) -> None:
    """One of 2 ranks (a subprocess of the test): for each case of FAIL_RANKS in turn (one
    pair of processes for both: each start-up imports torch), a fresh task and scorer score
    its rows and pool the named means."""
    from rlctl.dist.backends import build_backend
    from rlctl.train.metrics import reduce_metrics
    from rlctl.train.metrics import named_reward_metrics
    from rlctl.tasks.scoring import RewardScorer

    rank = int(os.environ["RANK"])
    backend = build_backend("torch", "cpu")
    for fail_rank in FAIL_RANKS:
        task, examples = _examples(ROWS[rank])
        if rank == fail_rank:
            def boom(example, completion):
                raise RuntimeError("broken reward")
            task.reward_components = boom
            task.reward = boom
        scorer = RewardScorer(task, timeout_s=0, on_error="zero")
        scorer.score_batch(examples, [c for _, c in ROWS[rank]])
        values = reduce_metrics(named_reward_metrics(*scorer.named_sums(), backend), backend)
        (Path(out_dir) / f"rank{rank}-fail{fail_rank}.json").write_text(json.dumps(values))
    backend.close()


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    """The directory of both cases' rank<r>-fail<f>.json, from one run of 2 ranks."""
    out = tmp_path_factory.mktemp("named-ranks")
    run_two_ranks("test_named_reward_ranks", f"_rank_worker({str(out)!r})", out, 120)
    return out


def _designs(rank):
    task, examples = _examples(ROWS[rank])
    return [task.score_all(ex, c) for ex, (_, c) in zip(examples, ROWS[rank])]


@pytest.mark.parametrize("fail_rank", FAIL_RANKS, ids=FAIL_IDS)
def test_two_ranks_log_the_mean_of_every_rank_s_samples(pooled, fail_rank):
    per_rank = {r: _designs(r) for r in range(2)}
    names = sorted(per_rank[0][0])
    assert len(names) >= 3          # the sorting designs: exact, positional, ...
    want = {}
    for k in names:                 # float64 mean over all 8 samples; a failed one is 0
        vals = [0.0 if r == fail_rank else d[k] for r in range(2) for d in per_rank[r]]
        want[f"reward/{k}"] = float(np.mean(np.array(vals, dtype=np.float64)))
    rank0_alone = {f"reward/{k}": float(np.mean([d[k] for d in per_rank[0]])) for k in names}
    assert any(abs(rank0_alone[k] - want[k]) > 1e-3 for k in want)   # the check can fail
    for r in range(2):
        got = json.loads((pooled / f"rank{r}-fail{fail_rank}.json").read_text())
        assert sorted(got) == sorted(want)
        # float64: the pooled mean ma + (mb - ma) nb / n of O(1) values differs from
        # numpy's sum / 8 by a few roundings, < 1e-15
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=0, abs=1e-12), k


def test_a_two_process_run_logs_every_rank_s_named_rewards(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([RLCTL, "train", "hardware.num_processes=2", "trainer.steps=3",
                          "trainer.eval_every=0", "trainer.prompts_per_step=8", "algo.group_size=2",
                          "logger=jsonl", "logger.console=false", "rollout.max_new_tokens=8",
                          "task.num_eval=4", "run.save_model=false",
                          f"run.output_dir={tmp_path}/runs"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert len(rows) == 3
    for r in rows:
        # task.reward=positional: each sample's training reward is its positional design.
        # reward/mean: float32 rewards averaged per rank (values k/5, 8 per rank: error
        # < 8 ulp of 1 = 1e-6), pooled in float64; reward/positional: float64 throughout
        assert r["reward/positional"] == pytest.approx(r["reward/mean"], rel=0, abs=2e-6)
