"""Kill and resume: a run killed with SIGKILL (or stopped with Ctrl-C) and resumed ends
with exactly the metrics of an uninterrupted run with the same seed."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.train.run import SHAPE_KEYS, ResumeSettings

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
# 8 steps (was 12): a kill after step 5 or 6 still finds one checkpoint (4) and leaves 4
# steps to resume, each compared with the uninterrupted run's; nothing asserted needs more
STEPS = 8
ARGS = [f"trainer.steps={STEPS}", "trainer.checkpoint_every=4", "trainer.eval_every=4", "task.num_eval=32",
        "trainer.prompts_per_step=4", "logger=jsonl", "logger.console=false", "run.save_model=false",
        "logger.samples.every=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _rows(run: Path):
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            out[row["step"]] = {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}
    return out


def _samples(run: Path):
    """samples.jsonl's rows, in the order written."""
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def _run_dir(root: Path) -> Path:
    return next(p for p in root.iterdir() if p.is_dir())


def _start_and_stop_after(root: Path, step: int, sig) -> subprocess.Popen:
    proc = subprocess.Popen([RLCTL, "train", *ARGS, f"run.output_dir={root}"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = list(root.glob("*/metrics.jsonl"))
        if metrics and f'"step": {step},' in metrics[0].read_text():
            proc.send_signal(sig)
            break
        time.sleep(0.05)
    proc.wait(timeout=120)
    return proc


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    out = subprocess.run([RLCTL, "train", *ARGS, f"run.output_dir={root}"], env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return _run_dir(root)


@pytest.fixture(scope="module")
def uninterrupted(full_run):
    return _rows(full_run)


def test_sigkill_then_resume_matches_uninterrupted(uninterrupted, full_run, tmp_path):
    proc = _start_and_stop_after(tmp_path, 6, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    run = _run_dir(tmp_path)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]
    out = subprocess.run([RLCTL, "train", "--resume", str(run)], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    resumed = _rows(run)
    assert sorted(resumed) == list(range(STEPS + 1))           # no step lost, none twice
    for step in range(STEPS + 1):
        assert resumed[step] == uninterrupted[step], step
    # the sample tables of the steps redone after the checkpoint are not kept twice
    assert _samples(run) == _samples(full_run)


def test_ctrl_c_saves_and_resumes(uninterrupted, tmp_path):
    proc = _start_and_stop_after(tmp_path, 5, signal.SIGINT)
    assert proc.returncode == 130
    err = proc.stderr.read()
    assert "Resume with: rlctl train --resume" in err, err
    run = _run_dir(tmp_path)
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved[-1] >= "step-00000005"                        # the step in flight was finished
    out = subprocess.run([RLCTL, "train", "--resume", str(run)], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _rows(run) == uninterrupted


def test_corrupt_checkpoint_and_missing_run_are_one_line(tmp_path, rlctl_app):
    assert _start_and_stop_after(tmp_path, 5, signal.SIGKILL).returncode == -signal.SIGKILL
    run = _run_dir(tmp_path)
    (run / "checkpoints" / "step-00000004" / "optimizer.pt").write_bytes(b"not a checkpoint")
    # the refusals through the CLI app in-process (the resumes above run the console script)
    out = rlctl_app("train", "--resume", str(run))
    assert out.returncode == 2 and "unreadable or incomplete" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = rlctl_app("train", "--resume", str(tmp_path / "nope"))
    assert out.returncode == 2 and "not a run directory" in out.stderr


def test_resume_settings_compare_the_shape_keys_a_config_sets():
    """What a resume is checked against, from a composed config (a list key as a plain
    list; the ZeRO keys only under deepspeed) and from an older run's config.yaml that
    lacks most keys (left out, so a resume is not refused for a key that run never had)."""
    cfg = compose(["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj]",
                   "trainer.steps=7"]).cfg
    new = ResumeSettings.from_config(cfg)
    assert new.steps == 7 and set(new.shape) == set(SHAPE_KEYS)
    assert new.shape["model.lora.r"] == 4 and new.shape["model.lora.enabled"] is True
    assert new.shape["model.lora.target_modules"] == ["q_proj"]
    assert "hardware.zero_stage" not in new.shape
    ds = ResumeSettings.from_config(OmegaConf.merge(cfg, {"hardware": {"backend": "deepspeed",
                                                                        "zero_stage": 2}}))
    assert ds.shape["hardware.zero_stage"] == 2 and ds.shape["hardware.backend"] == "deepspeed"
    assert "hardware.num_processes" in ds.shape
    old = ResumeSettings.from_config(OmegaConf.create({"model": {"name": "tiny"}, "trainer": {"steps": 3}}))
    assert old.shape == {"model.name": "tiny"} and old.steps == 3
