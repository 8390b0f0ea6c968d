"""Asynchronous mode (local engine processes + learner): with max_staleness=0 it is the
synchronous loop bit for bit; with max_staleness=1 rollouts are one step old and the
ratio against the behaviour policy's log-probs is logged."""
import os

from omegaconf import OmegaConf

from rlctl.config.compose import compose
from rlctl.train.trainer import Trainer
from rlctl.train.sources import build_source
from rlctl.sinks import NullSink

BASE = ["trainer.prompts_per_step=4", "algo.group_size=4", "trainer.eval_every=0", "trainer.lr=1e-3"]


def _run(make_trainer, overrides, steps=3):
    tr = make_trainer(BASE + overrides)          # closed by the fixture
    return [tr.step(i) for i in range(1, steps + 1)]


def _same(a, b):
    keys = [k for k in a if not k.startswith(("time/", "perf/"))]
    assert keys and all(k in b for k in keys)
    return {k: (a[k], b[k]) for k in keys if a[k] != b[k]}


def test_async_with_zero_staleness_matches_the_sync_loop(make_trainer):
    sync = _run(make_trainer, [])
    asyn = _run(make_trainer, ["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=0"])
    for s, a in zip(sync, asyn):
        assert _same(s, a) == {}                     # exact: same RNG stream, same weights
        assert a["async/staleness"] == 0
    assert _same(sync[0], sync[1]) != {}             # the steps do differ (the check can fail)


def test_async_one_step_stale_uses_behaviour_logprobs(make_trainer):
    steps = _run(make_trainer, ["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=1"])
    assert [s["async/staleness"] for s in steps] == [0, 1, 1]
    assert "policy/ratio_std" not in steps[0]        # on-policy: no correction needed
    assert steps[2]["policy/ratio_std"] > 0          # stale: pi / pi_behaviour != 1
    assert all(s["time/learner_wait_s"] >= 0 and s["time/engine_generate_s"] > 0 for s in steps)


def test_two_actors_work_ahead_within_the_staleness_bound(make_trainer):
    """num_actors=2, max_staleness=2: while the learner updates, both actors generate;
    rollouts for steps 1, 2 come from the initial weights, later ones are 2 updates old
    (hand-traced from the request rule: step c may be requested once version >= c-1-2)."""
    tr = make_trainer(BASE + ["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=2",
                              "trainer.async_rollout.num_actors=2"])
    assert [e.name for e in tr.source.engines] == ["rollout engine process 1", "rollout engine process 2"]
    assert len({e.proc.pid for e in tr.source.engines}) == 2      # two processes
    steps = [tr.step(i) for i in range(1, 6)]
    assert [s["async/staleness"] for s in steps] == [0, 1, 2, 2, 2]
    assert all(s["policy/ratio_std"] > 0 for s in steps[1:])
    assert all(0 <= s["reward/mean"] <= 1 for s in steps)


def test_a_failing_reward_in_an_actor_is_one_error_not_a_hang(tmp_path):
    """task.on_reward_error=raise with local engines: the learner raises the RewardError
    with the reward's message (the CLI prints it as one line), and close() returns with
    the engine processes ended."""
    import json
    import time

    import pytest

    from rlctl.errors import RewardError

    (tmp_path / "bad_reward.py").write_text("def reward(prompt, completion, **f):\n"
                                            "    raise ValueError('boom from the reward')\n")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} 3 1 ="}) + "\n" for i in range(10)))
    cfg = compose(BASE + ["task=jsonl", f"task.train_path={data}", "task.num_eval=2",
                          f"task.reward_fn={tmp_path / 'bad_reward.py'}:reward",
                          "task.on_reward_error=raise", "trainer.async_rollout.enabled=true"]).cfg
    OmegaConf.resolve(cfg)
    from rlctl.train.build import model_from_config, prepare_task
    model, _, tok, _ = model_from_config(cfg)
    task = prepare_task(cfg, tok, model, quiet=True)   # as rlctl train prepares it
    tr = Trainer.from_config(cfg, model, tok, task, NullSink(), source=build_source(cfg, model, tok, task))
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardError, match="boom from the reward"):
            tr.step(1)
    finally:
        tr.close()
    assert time.monotonic() - t0 < 120
    assert not any(e.proc.is_alive() for e in tr.source.engines)   # the engines are gone


def test_an_actor_that_dies_is_reported_not_waited_for(make_trainer):
    from rlctl.errors import ActorFailed
    import pytest

    tr = make_trainer(BASE + ["trainer.async_rollout.enabled=true"])
    tr.step(1)
    tr.source.engines[0].proc.kill()
    with pytest.raises(ActorFailed, match=r"^lost contact with rollout engine process 1: it exited "
                                          r"unexpectedly \(exit code -9\)$"):
        tr.step(2)
        tr.step(3)


def test_stale_rollouts_need_no_old_forward(make_trainer):
    """Two epochs need pi_old: an on-policy rollout gets it from a forward, a stale one
    already carries the behaviour log-probs, so (without a critic) no forward is made."""
    tr = make_trainer(BASE + ["trainer.async_rollout.enabled=true", "algo.epochs=2"])
    prepare, calls = tr._prepare, []

    def spy(batch, prompts):
        n = len(calls)
        h = tr.model.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            return prepare(batch, prompts)
        finally:
            h.remove()
            forwards.append(len(calls) - n)
    forwards = []
    tr._prepare = spy
    steps = [tr.step(i) for i in (1, 2)]
    assert [s["async/staleness"] for s in steps] == [0, 1]
    assert forwards[0] > 0 and forwards[1] == 0


def _count_rounds(tr):
    """Wrap the source's ``sample`` to record each received rollout (per step, a list of
    (real tokens of each row, behaviour log-probs of its counted tokens or None))."""
    per_step, sample = [], tr.source.sample

    def spy(n):
        b = sample(n)
        per_step[-1].append(_rows(b, b.logprobs.old))
        return b
    tr.source.sample = spy
    return per_step


def _rows(b, old):
    """[(tokens without padding, old log-probs of the counted tokens or None)] per row."""
    keep, m = b.attention_mask.bool(), b.mask.bool()
    return [(tuple(b.input_ids[r][keep[r]].tolist()), None if old is None else old[r][m[r]].clone())
            for r in range(b.num_sequences)]


def test_dapo_steps_with_three_or_more_sampling_rounds_run_async(make_trainer):
    """algo=dapo task.reward=exact with async rollouts: the untrained tiny model rarely
    sorts exactly, so most groups are constant and steps need 3-4 rounds. The learner
    must ask for rollouts beyond the staleness window within one step (this raised
    IndexError: pop from an empty deque), and no rollout may be more than
    max_staleness=1 updates old."""
    tr = make_trainer(BASE + ["algo=dapo", "task.reward=exact", "trainer.async_rollout.enabled=true",
                              "algo.max_sampling_rounds=4"])
    rounds = _count_rounds(tr)
    for i in (1, 2, 3):
        rounds.append([])
        values = tr.step(i)
        assert 0 <= values["async/staleness"] <= 1
        assert 0 <= values["rollout/kept_groups_frac"] <= 1
    assert max(len(r) for r in rounds) >= 3          # the case that crashed did happen


def test_a_step_mixing_stale_and_fresh_rollouts_keeps_behaviour_logprobs(tmp_path):
    """Dynamic sampling with max_staleness=1: a step's first rollout was made before the
    last update (stale: behaviour log-probs), later rounds with the current weights
    (on-policy). The stacked batch must keep every stale row's behaviour log-probs
    exactly (they used to be dropped: the whole batch trained with ratio 1), and fill the
    on-policy rows from the learner's pi_old forward. The reward is constant on odd
    prompts, so about half the groups are dropped and each step needs a second round."""
    import json

    (tmp_path / "half.py").write_text(
        "def reward(prompt, completion, **f):\n"
        "    return 0.0 if int(prompt.split()[0]) % 2 else float(sum(map(ord, completion)) % 5)\n")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} 3 1 ="}) + "\n" for i in range(40)))
    cfg = compose(BASE + ["algo=dapo", "task=jsonl", f"task.train_path={data}", "task.num_eval=2",
                          f"task.reward_fn={tmp_path / 'half.py'}:reward", "trainer.async_rollout.enabled=true"]).cfg
    OmegaConf.resolve(cfg)
    from rlctl.train.build import model_from_config, prepare_task
    model, _, tok, _ = model_from_config(cfg)
    task = prepare_task(cfg, tok, model, quiet=True)   # as rlctl train prepares it
    tr = Trainer.from_config(cfg, model, tok, task, NullSink(), source=build_source(cfg, model, tok, task))
    try:
        _check_mixed_steps(tr)
    finally:
        tr.close()


def _check_mixed_steps(tr):
    import torch

    from rlctl.models.forward import learner_forward

    rounds, prepare, seen = _count_rounds(tr), tr._prepare, []

    def spy(batch, prompts):
        batch = prepare(batch, prompts)
        with torch.no_grad():              # pi_old: the weights before this step's update
            logp = learner_forward(tr.model, batch.input_ids, batch.attention_mask, batch.prompt_len).logp
        seen.append((_rows(batch, batch.logprobs.old), _rows(batch, logp)))
        return batch
    tr._prepare = spy
    for i in (1, 2, 3):
        rounds.append([])
        tr.step(i)
    mixed = 0
    for received, (rows, learner) in zip(rounds, seen):
        stale = {}                          # tokens -> behaviour log-probs (stale rollouts)
        fresh = {t for rollout in received for t, o in rollout if o is None}
        for rollout in received:
            stale.update({t: o for t, o in rollout if o is not None})
        kinds = [(t in stale, t in fresh) for t, _ in rows]
        mixed += any(k == (True, False) for k in kinds) and any(k == (False, True) for k in kinds)
        for (t, old), (_, logp), kind in zip(rows, learner, kinds):
            if kind == (True, False):       # a stale row: exactly its behaviour log-probs,
                assert old is not None and torch.equal(old, stale[t])
                assert (logp - old).abs().max() > 1e-3 or len(old) == 0   # and ratio != 1
            elif kind == (False, True):     # on-policy: the learner's pi_old forward (run
                # prompt-shared in the trainer, not here: same float32 math, ~1e-6 apart)
                assert old is None or (logp - old).abs().max() < 1e-5
    assert mixed, "no step mixed a stale and a fresh rollout"


def test_engines_live_beside_the_learner_and_other_machines_are_servers():
    """num_actors local engines (one EngineSource engine each); num_actors=0 and async
    engines on several nodes are one line each: other machines run servers."""
    import pytest

    from rlctl.config.checks import validate
    from rlctl.errors import ConfigError

    with pytest.raises(ConfigError, match="num_actors"):
        validate(compose(["trainer.async_rollout.enabled=true", "trainer.async_rollout.num_actors=0"]).cfg)
    with pytest.raises(ConfigError, match=r"rollout.engine=server rollout.server.urls=\[http://NODE:PORT"):
        validate(compose(["trainer.async_rollout.enabled=true", "hardware.nnodes=2"]).cfg)
    validate(compose(["hardware.nnodes=2"]).cfg)               # data-parallel nodes: still fine


def test_a_silent_or_lost_engine_is_one_line_naming_it():
    """A local engine that does not answer within its time limit, and one that exited,
    are each one line naming the process (the child here never reads its pipe)."""
    import multiprocessing
    import time

    import pytest

    from rlctl.errors import ActorFailed
    from rlctl.rollout.engines.engine_source import LocalEngine

    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    engine = LocalEngine(proc, mine, "rollout engine process 1", timeout_s=1.0)
    with pytest.raises(ActorFailed, match=r"^lost contact with rollout engine process 1: it did not "
                                          r"answer within 1 s$"):
        engine.health()
    proc.kill()
    with pytest.raises(ActorFailed, match=r"^lost contact with rollout engine process 1: it exited "
                                          r"unexpectedly \(exit code -9\)$"):
        engine.health()
