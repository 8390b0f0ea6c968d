"""task.reward_norm=running with several ranks: each rank's batch statistics are merged
over the process group before the update, so every rank normalises with the statistics
of the whole step's batch. Two gloo ranks on 127.0.0.1, each scoring half of every
step's completions with a real reward model, against one process scoring all of them;
and a real 2-process `rlctl train`, whose checkpoint holds the statistics of every
rank's scores (it held rank 0's alone, or the run was refused)."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlctl.demo import tiny
from rlctl.rm.learned import build_learned_rewards
from rlctl.types import Example

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
# three steps of 8 completions; rank r scores rows r*4 .. r*4+3 of each step
STEPS = [[(f"{a} {b} =", f"{b} {a}") for a in range(i, i + 2) for b in range(4)]
         for i in (0, 3, 6)]


def save_rm(path: Path) -> Path:
    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, num_labels=1)).double().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _score_steps(rm_dir, rows_of):
    learned = build_learned_rewards(str(rm_dir), [], "running", None, "cpu")
    totals, stats = [], []
    for step in STEPS:
        rows = rows_of(step)
        out, _ = learned.score([Example(prompt=p, fields={}) for p, _ in rows],
                               [c for _, c in rows], update=True)
        totals.append(out)
        stats.append(learned.norms["reward_model"].state())
    return totals, stats


def _rank(rank, world, port, rm_dir, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        totals, stats = _score_steps(rm_dir, lambda step: step[rank * 4:(rank + 1) * 4])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([totals, stats]))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_normalise_as_one_process_on_the_same_scores(tmp_path):
    rm_dir = save_rm(tmp_path / "rm")
    one_totals, one_stats = _score_steps(rm_dir, lambda step: step)
    mp.start_processes(_rank, args=(2, _free_port(), str(rm_dir), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    for rank in range(2):
        totals, stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for step in range(len(STEPS)):
            assert stats[step]["count"] == one_stats[step]["count"] == 8 * (step + 1)
            # float64: the merge of two halves differs from one pass only by rounding
            # of a few operations on O(1) numbers
            assert stats[step]["mean"] == pytest.approx(one_stats[step]["mean"], rel=1e-12, abs=1e-12)
            assert stats[step]["m2"] == pytest.approx(one_stats[step]["m2"], rel=1e-12)
            want = one_totals[step][rank * 4:(rank + 1) * 4]
            assert totals[step] == pytest.approx(want, rel=1e-10, abs=1e-10)


FAST = ["trainer.steps=2", "trainer.eval_every=0", "trainer.prompts_per_step=4",
        "algo.group_size=2", "logger=jsonl", "logger.console=false",
        "rollout.max_new_tokens=6", "task.num_eval=4"]


def test_a_two_process_run_keeps_every_rank_s_statistics(tmp_path):
    rm_dir = save_rm(tmp_path / "rm")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([RLCTL, "train", "hardware.num_processes=2", "task.reward_norm=running",
                          f"task.reward_model={rm_dir}", f"run.output_dir={tmp_path}/runs", *FAST],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    (ckpt,) = sorted((run / "checkpoints").glob("step-*"))[-1:]
    norm = json.loads((ckpt / "trainer_state.json").read_text())["scorer"]["reward_norm"]
    # 2 steps x 4 prompts x 2 samples over both ranks (rank 0's own would be 8); the
    # values themselves are checked against one process in the test above
    assert norm["reward_model"]["count"] == 2 * 4 * 2
    assert norm["reward_model"]["m2"] > 0


def test_running_norm_with_dynamic_sampling_on_several_ranks_is_one_line(tmp_path):
    """Ranks that sample different numbers of rounds cannot merge once per round."""
    from typer.testing import CliRunner

    from rlctl.cli import app

    rm_dir = save_rm(tmp_path / "rm")
    res = CliRunner().invoke(app, ["train", "hardware.num_processes=2", "task.reward_norm=running",
                                   "algo.dynamic_sampling=true", f"task.reward_model={rm_dir}",
                                   f"run.output_dir={tmp_path}/runs", *FAST])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "set algo.dynamic_sampling=false" in lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
