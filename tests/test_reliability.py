"""Nothing lost: signals on one and two ranks, safe resumes, the run-directory lock, and
set-up failures that leave nothing behind. Each case checks the exit code, the one line on
stderr and the files on disk. Signals, locks held by other processes and launched ranks
run `rlctl` as a user does (a subprocess); the resume refusals and extensions, the
one-rank set-up failures and the one-rank commands run beside a stopped or a running
process (the resume after a stale lock, the resume refused by a live one) run the same
Typer app in-process (``rlctl_app``), as nothing there depends on the process boundary."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlctl.cli import app

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
# The stops are signalled once step 2 is logged and take effect after the step in flight
# (3, or 4 when two ranks agree on it a step later), so any STEPS >= 5 keeps them inside the
# run; 8 leaves 4 steps for a late signal, and keeps each resume to the end short.
STEPS = 8
FAST = ["trainer.eval_every=0", "trainer.prompts_per_step=4", "trainer.checkpoint_every=0",
        "logger=jsonl", "logger.console=false", "run.save_model=false"]
HINT = re.compile(r"^interrupted by (SIGINT|SIGTERM) after step (\d+); checkpoint saved\. "
                  r"Resume with: (rlctl train --resume .+)$")


def _run(*args, timeout=300):
    return subprocess.run([RLCTL, *args], env=ENV, capture_output=True, text=True, timeout=timeout)


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _steps(run: Path):
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "step" in r]


def _run_dir(root: Path) -> Path:
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return run


def _stop_after(root: Path, step: int, sig, group: bool, extra=()) -> subprocess.CompletedProcess:
    """Start a run, send ``sig`` once ``step`` is logged: to the whole process group (as a
    terminal's Ctrl-C or `timeout` do) or to the rlctl process alone (as Kubernetes does)."""
    proc = subprocess.Popen([RLCTL, "train", f"trainer.steps={STEPS}", *FAST, *extra,
                             f"run.output_dir={root}"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        metrics = list(root.glob("*/metrics.jsonl"))
        if metrics and f'"step": {step},' in metrics[0].read_text():
            (os.killpg if group else os.kill)(proc.pid, sig)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


def _lingering(run: Path):
    """Processes whose command line names the run directory (launched ranks)."""
    found = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run).encode() in cmd.read_bytes():
                found.append(cmd.parent.name)
        except OSError:
            continue
    return found


def _check_stopped(out, root: Path, sig):
    """Exit 128 + sig, the last stderr line names the step and a resume command that
    works when pasted as printed, the checkpoint of that step is on disk, no rank left."""
    assert out.returncode == 128 + sig, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    m = HINT.match(last)
    assert m and m.group(1) == signal.Signals(sig).name, last
    step, command = int(m.group(2)), m.group(3)
    run = _run_dir(root)
    assert shlex.split(command)[3:] == [str(run)]          # quoted: the path has a space
    assert 2 <= step < STEPS
    (ckpt,) = sorted((run / "checkpoints").iterdir())
    assert ckpt.name == f"step-{step:08d}"
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step
    assert _steps(run) == list(range(1, step + 1))
    assert not _lingering(run)
    return run, shlex.split(command)


def _resumed_to_end(command, run: Path, rlctl_app=None):
    """Run the printed resume command to the end: through the console script, or (a
    one-rank run, nothing process-bound left to check) the same app in-process."""
    if rlctl_app is not None:
        out = rlctl_app(*command[1:])
    else:
        out = subprocess.run([RLCTL, *command[1:]], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _steps(run) == list(range(1, STEPS + 1))          # none lost, none twice
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    assert not (run / ".lock").exists()


def test_ctrl_c_to_the_process_group_one_rank_saves_and_a_stale_lock_is_taken_over(tmp_path, rlctl_app):
    root = tmp_path / "my runs"
    run, command = _check_stopped(_stop_after(root, 2, signal.SIGINT, group=True), root, signal.SIGINT)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / ".lock").write_text(f"{dead.pid}\n")              # left by a killed run
    _resumed_to_end(command, run, rlctl_app)   # in-process: the lock's holder is another pid either way


def test_sigterm_one_rank_saves_and_a_second_resume_is_refused_while_the_first_runs(tmp_path, rlctl_app):
    """The first resume extends the run far past what any machine finishes during the test,
    so it surely holds the lock when the second starts (a plain 16-step resume can finish
    before a second process is up, on a fast machine); the second is refused naming its
    pid; the first, stopped by SIGTERM, leaves one row per step, none twice."""
    root = tmp_path / "my runs"
    run, command = _check_stopped(_stop_after(root, 2, signal.SIGTERM, group=False), root, signal.SIGTERM)
    first = subprocess.Popen([RLCTL, *command[1:], "trainer.steps=100000"], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and first.poll() is None and not _holds_lock(run, first.pid):
        time.sleep(0.05)
    assert first.poll() is None and _holds_lock(run, first.pid)
    second = rlctl_app(*command[1:])     # in-process: the holder is the other process, `first`
    line = _one_line(second.stderr)
    assert second.returncode == 2 and f"in use by another rlctl process (pid {first.pid})" in line, line
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=180)
    assert first.returncode == 128 + signal.SIGTERM, err[-2000:]
    steps = _steps(run)
    assert len(steps) >= 2 and steps == list(range(1, len(steps) + 1))  # one writer: no interleaved rows


def _holds_lock(run: Path, pid: int) -> bool:
    try:
        return str(pid) in (run / ".lock").read_text().split()
    except OSError:
        return False


@pytest.mark.parametrize("sig,group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-group", "sigterm"])
def test_two_ranks_stop_after_the_same_step_save_and_resume(tmp_path, sig, group):
    root = tmp_path / "my runs"
    out = _stop_after(root, 2, sig, group, extra=["hardware.num_processes=2"])
    run, command = _check_stopped(out, root, sig)
    assert (run / "rank1.log").read_text().count("Traceback") == 0
    _resumed_to_end(command, run)


def _workers_of(root: Path):
    """Pids of launched ranks (`python -m rlctl.train.worker RUN`) whose run is under ``root``."""
    found = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmd.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rlctl.train.worker" in argv and any(str(root).encode() in a for a in argv):
            found.append(int(cmd.parent.name))
    return found


@pytest.mark.parametrize("delay", [0.0, 0.3], ids=["at-start", "while-importing"])
def test_sigterm_while_ranks_start_is_a_clean_stop(tmp_path, delay):
    """Either no step ran (exit 143, nothing left behind) or the ranks finished a step and
    saved it (exit 143 and the resume hint); never a rank 'exited with code -15'."""
    root = tmp_path / "runs"
    proc = subprocess.Popen([RLCTL, "train", "trainer.steps=4", *FAST, "hardware.num_processes=2",
                             f"run.output_dir={root}"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(_workers_of(root)) < 2 and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = _one_line(err.replace("SIGTERM: stopping after this step and saving a checkpoint", ""))
    if "before the first step" in last:
        assert last == "interrupted by SIGTERM before the first step; nothing was saved"
        assert list(root.iterdir()) == []
    else:
        assert HINT.match(last), last
        assert (_run_dir(root) / "checkpoints").is_dir()
    assert not _workers_of(root)


# ---- resume: refused before anything is written, or extended ----------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    out = CliRunner().invoke(app, ["train", "trainer.steps=3", *FAST, f"run.output_dir={root}"],
                             catch_exceptions=False)                      # in-process
    assert out.exit_code == 0, out.stderr[-2000:]
    return _run_dir(root)


def _snapshot(run: Path):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resume_of_a_finished_run_is_refused_and_changes_nothing(finished, rlctl_app):
    before = _snapshot(finished)
    for extra in ([], ["trainer.steps=2"]):
        out = rlctl_app("train", "--resume", str(finished), *extra)
        assert out.returncode == 2
        line = _one_line(out.stderr)
        assert "already finished at step 3" in line and "raise trainer.steps" in line, line
    assert _snapshot(finished) == before                       # summary.json, config.yaml: same bytes


@pytest.mark.parametrize("override,changed", [("algo=ppo", "algo.critic: none -> shared"),
                                              ("model.lora.enabled=true", "model.lora.enabled")])
def test_resume_with_a_shape_changing_override_is_refused(finished, override, changed, rlctl_app):
    before = _snapshot(finished)
    out = rlctl_app("train", "--resume", str(finished), override, "trainer.steps=5")
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert "changes the model's shape" in line and "cannot apply to a resume" in line, line
    assert changed in line and "unreadable" not in line, line
    assert _snapshot(finished) == before


@pytest.mark.parametrize("case", ["gradient-checkpointing", "key-missing-from-an-older-run"])
def test_resume_accepts_what_does_not_change_the_shape(finished, tmp_path, case, rlctl_app):
    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    extra = ["model.gradient_checkpointing=true"] if case == "gradient-checkpointing" else []
    if case == "key-missing-from-an-older-run":        # a run made before the key existed
        config = run / "config.yaml"
        lines = config.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if not ln.strip().startswith("gradient_checkpointing:")]
        assert len(kept) == len(lines) - 1
        config.write_text("".join(kept))
    out = rlctl_app("train", "--resume", str(run), "trainer.steps=4", *extra)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _steps(run) == [1, 2, 3, 4]


def test_empty_trainer_state_is_one_line_naming_the_file(finished, tmp_path, rlctl_app):
    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    state = run / "checkpoints" / "step-00000003" / "trainer_state.json"
    state.write_text("{}")
    out = rlctl_app("train", "--resume", str(run), "trainer.steps=5")
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert str(state) in line and "'step'" in line and "KeyError" not in line, line


def test_resume_with_more_steps_extends_the_run(finished, tmp_path, rlctl_app):
    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    out = rlctl_app("train", "--resume", str(run), "trainer.steps=5")
    assert out.returncode == 0, out.stderr[-2000:]
    assert _steps(run) == [1, 2, 3, 4, 5]
    assert json.loads((run / "summary.json").read_text())["steps"] == 5


def test_a_resume_keeps_its_overrides_for_the_next_resume(finished, tmp_path, rlctl_app):
    """Extend 3 -> 6 steps with a new lr, lose the last two checkpoints (as a kill after
    step 4 would), then resume as the interrupt hint says: no overrides."""
    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    out = rlctl_app("train", "--resume", str(run), "trainer.steps=6", "trainer.lr=0.000123",
               "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5")
    assert out.returncode == 0, out.stderr[-2000:]
    for step in (5, 6):
        shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    out = rlctl_app("train", "--resume", str(run))
    assert out.returncode == 0, out.stderr[-2000:]
    assert _steps(run) == [1, 2, 3, 4, 5, 6]
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    config = (run / "config.yaml").read_text()
    assert "lr: 0.000123" in config and "steps: 6" in config, config
    assert "trainer.lr=0.000123" in (run / "overrides.yaml").read_text()


# ---- set-up failures leave no run directory -----------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2])
def test_bad_lora_target_leaves_no_run_directory(tmp_path, ranks, rlctl_app):
    # one rank in-process; two ranks through the console script, which launches them
    out = (_run if ranks == 2 else rlctl_app)("train", "trainer.steps=2", *FAST, "model.lora.enabled=true",
               "model.lora.target_modules=[nope]", f"hardware.num_processes={ranks}",
               f"run.output_dir={tmp_path}")
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert line.startswith("error: model.lora:") and "valid:" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_set_up_failure_in_the_users_own_run_dir_keeps_their_files(tmp_path, rlctl_app):
    mine = tmp_path / "mydir"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "sub" / "data.txt").write_text("also mine")
    out = rlctl_app("train", "trainer.steps=2", *FAST, f"run.dir={mine}", "model.lora.enabled=true",
               "model.lora.target_modules=[nope]")
    assert out.returncode == 2
    assert _one_line(out.stderr).startswith("error: model.lora:")
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == ["notes.txt", "sub", "sub/data.txt"]
    assert (mine / "notes.txt").read_text() == "mine"


def _wait_until(cond, seconds=120.0):
    deadline = time.time() + seconds
    while time.time() < deadline and not cond():
        time.sleep(0.05)
    return cond()


def test_launched_ranks_keep_the_run_locked_after_the_launcher_is_killed(tmp_path):
    from rlctl.storage.rundir import RunLock
    from rlctl.errors import RunDirError

    root = tmp_path / "runs"
    proc = subprocess.Popen([RLCTL, "train", f"trainer.steps={STEPS}", *FAST, "hardware.num_processes=2",
                             f"run.output_dir={root}"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    assert _wait_until(lambda: any('"step": 1,' in m.read_text() for m in root.glob("*/metrics.jsonl")))
    ranks = _workers_of(root)
    proc.kill()                                  # SIGKILL: the launcher's flock goes with it
    proc.wait()
    run = _run_dir(root)
    try:
        with pytest.raises(RunDirError, match=r"in use by another rlctl process \(pid (\d+)\)") as err:
            RunLock(run).acquire()               # the ranks are still saving: refused
        assert int(re.search(r"pid (\d+)", str(err.value)).group(1)) in ranks
    finally:
        proc.wait()
    assert _wait_until(lambda: _can_lock(run))   # every rank has exited: stale, taken over
    assert checkpoint_steps(run)                 # SIGTERM from the kernel: they saved


def _can_lock(run: Path) -> bool:
    from rlctl.storage.rundir import RunLock
    from rlctl.errors import RunDirError
    try:
        RunLock(run).acquire().release()
    except RunDirError:
        return False
    return True


def checkpoint_steps(run: Path):
    return sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []


SLOW_REWARD = """import os, time
def slow(prompt, completion, **fields):
    open(os.environ["SLOW_MARK"], "w").write(str(os.getpid()))
    time.sleep(120)
    return 0.0
"""


def test_a_reward_worker_stuck_in_a_call_does_not_keep_the_run_locked(tmp_path):
    from rlctl.storage.rundir import RunLock

    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i} 3 1 ="}) + "\n"
                                                  for i in range(12)))
    mark, root = tmp_path / "reward.pid", tmp_path / "runs"
    env = dict(ENV, PYTHONPATH=str(tmp_path), SLOW_MARK=str(mark))
    proc = subprocess.Popen([RLCTL, "train", "trainer.steps=2", *FAST, "task=jsonl", "task.train_path=train.jsonl",
                             "task.reward_fn=slow:slow", f"run.output_dir={root}"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait_until(lambda: mark.exists() and mark.read_text()), "the reward was never called"
        proc.kill()                              # the trainer dies; its reward worker sleeps on
        proc.wait()
        with RunLock(_run_dir(root)):            # not held by the worker's copy of the descriptor
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
        if mark.exists() and mark.read_text():
            try:
                os.kill(int(mark.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- the lock, in-process -----------------------------------------------------------------
def test_run_lock_refuses_a_live_holder_by_pid_and_takes_over_a_dead_ones(tmp_path):
    from rlctl.storage.rundir import RunLock
    from rlctl.errors import RunDirError

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from rlctl.storage.rundir import RunLock; "
                               f"RunLock(Path({str(tmp_path)!r})).acquire(); print('ok', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        with pytest.raises(RunDirError, match=rf"in use by another rlctl process \(pid {holder.pid}\)"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / ".lock").read_text().strip() == str(holder.pid)   # stale: its holder is dead
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    assert not (tmp_path / ".lock").exists()
