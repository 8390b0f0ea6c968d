"""Episodes on 2 gloo ranks (hardware.num_processes=2 on the CPU): each rank plays its share
of the step's rows (one row x 2 episodes), and the logged metrics are those of every
rank's episodes. The ranks run as subprocesses (tests/train/gloo_ranks.py), each a
Trainer built as `rlctl train` builds it; each writes its reduced metrics and its own
episodes; the test recomputes the pooled values from the episodes of both ranks. The
weights stay equal on both ranks (one update of the summed gradients)."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "train"))
from gloo_ranks import run_two_ranks  # noqa: E402

from episode_runs import env_file, run_args  # noqa: E402

STEPS = 2


def _rank_worker(out_dir: str, spec: str) -> None:
    """One of 2 ranks (a subprocess of the test): 2 steps; its metrics and episodes."""
    from episode_runs import build_trainer
    from rlctl.dist.backends import build_backend
    from rlctl.types import TOKEN_LIMIT, TURN_LIMIT

    rank = int(os.environ["RANK"])
    backend = build_backend("torch", "cpu")
    tr = build_trainer(run_args(spec) + ["hardware.num_processes=2"], backend)
    batches, sample = [], tr.source.sample
    tr.source.sample = lambda n: batches.append(sample(n)) or batches[-1]   # the step's batch
    try:
        logged = [tr.step(i) for i in range(1, STEPS + 1)]
        episodes = [[{"turns": e.turns, "success": e.success, "reward": float(r),
                      "turn_limit": e.status == TURN_LIMIT, "token_limit": e.status == TOKEN_LIMIT,
                      "obs_tokens": sum(s.end - s.start for s in e.spans if s.role == "observation")}
                     for e, r in zip(b.episodes.records, b.rewards)] for b in batches]
        weights = float(sum(p.double().sum() for p in tr.policy.parameters()))
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(
            {"logged": logged, "episodes": episodes, "weights": weights,
             "rows": [b.num_sequences for b in batches]}))
    finally:
        tr.close()
        backend.close()


def test_two_ranks_play_their_share_and_log_every_rank_s_episodes(tmp_path):
    spec = env_file(tmp_path)
    run_two_ranks("test_episode_ranks", f"_rank_worker({str(tmp_path)!r}, {spec!r})", tmp_path, 180,
                  paths=[HERE])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rows"] for r in ranks] == [[2] * STEPS] * 2    # 2 prompts x 2 episodes over 2 ranks
    assert ranks[0]["weights"] == ranks[1]["weights"]          # one update on both
    alone = []                              # rank 0's own means, which pooling must not give
    for step in range(STEPS):
        both = ranks[0]["episodes"][step] + ranks[1]["episodes"][step]
        alone += [(np.mean([e[k] for e in ranks[0]["episodes"][step]]), np.mean([e[k] for e in both]))
                  for k in ("turns", "obs_tokens", "reward")]
        want = {"episode/turns_mean": np.mean([e["turns"] for e in both]),
                "episode/obs_tokens_mean": np.mean([e["obs_tokens"] for e in both]),
                "episode/turn_limit_frac": np.mean([e["turn_limit"] for e in both]),
                "episode/token_limit_frac": np.mean([e["token_limit"] for e in both]),
                "episode/success_rate": np.mean([e["success"] for e in both if e["success"] is not None]),
                "reward/mean": np.mean([e["reward"] for e in both])}
        for r in ranks:
            got = r["logged"][step]
            for k, v in want.items():      # float64 means of a few small numbers
                assert got[k] == pytest.approx(float(v), abs=1e-6), (step, k)
        rank0 = {k: (ranks[0]["logged"][step][k], ranks[1]["logged"][step][k]) for k in want}
        assert all(a == b for a, b in rank0.values())          # the same values on both ranks
    assert any(a != b for a, b in alone)    # the check can fail: rank 0 alone differs
