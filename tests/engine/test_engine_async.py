"""Asynchronous mode (rollout actor process + learner): with max_staleness=0 it is the
synchronous loop bit for bit; with max_staleness=1 rollouts are one step old and the
ratio against the behaviour policy's log-probs is logged."""
import os

from omegaconf import OmegaConf

from rlctl.compose import compose
from rlctl.learner.trainer import Trainer
from rlctl.run.rollout_setup import build_source
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
    assert all(s["time/learner_wait_s"] >= 0 and s["time/actor_wait_s"] >= 0 for s in steps)


def test_two_actors_work_ahead_within_the_staleness_bound(make_trainer):
    """num_actors=2, max_staleness=2: while the learner updates, both actors generate;
    rollouts for steps 1, 2 come from the initial weights, later ones are 2 updates old
    (hand-traced from the request rule: step c may be requested once version >= c-1-2)."""
    steps = _run(make_trainer, ["trainer.async_rollout.enabled=true", "trainer.async_rollout.max_staleness=2",
                  "trainer.async_rollout.num_actors=2"], steps=5)
    assert [s["async/staleness"] for s in steps] == [0, 1, 2, 2, 2]
    assert all(s["policy/ratio_std"] > 0 for s in steps[1:])
    assert all(0 <= s["reward/mean"] <= 1 for s in steps)


def test_a_failing_reward_in_an_actor_is_one_error_not_a_hang(tmp_path):
    """task.on_reward_error=raise inside an actor: the learner raises the RewardError with
    the actor's message (the CLI prints it as one line), and close() returns."""
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
    from rlctl.run.build import model_from_config, prepare_task
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
    assert not os.path.exists(tr.source.rendezvous_dir)        # the group's temp dir is gone


def test_an_actor_that_dies_is_reported_not_waited_for(make_trainer):
    from rlctl.errors import ActorFailed
    import pytest

    tr = make_trainer(BASE + ["trainer.async_rollout.enabled=true"])
    tr.step(1)
    tr.source.procs[0].kill()
    with pytest.raises(ActorFailed, match="exited unexpectedly"):
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
        per_step[-1].append(_rows(b, b.old_logprobs))
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
    from rlctl.run.build import model_from_config, prepare_task
    model, _, tok, _ = model_from_config(cfg)
    task = prepare_task(cfg, tok, model, quiet=True)   # as rlctl train prepares it
    tr = Trainer.from_config(cfg, model, tok, task, NullSink(), source=build_source(cfg, model, tok, task))
    try:
        _check_mixed_steps(tr)
    finally:
        tr.close()


def _check_mixed_steps(tr):
    import torch

    from rlctl.learner.forward import learner_forward

    rounds, prepare, seen = _count_rounds(tr), tr._prepare, []

    def spy(batch, prompts):
        batch = prepare(batch, prompts)
        with torch.no_grad():              # pi_old: the weights before this step's update
            logp = learner_forward(tr.model, batch.input_ids, batch.attention_mask, batch.prompt_len).logp
        seen.append((_rows(batch, batch.old_logprobs), _rows(batch, logp)))
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


def test_actors_live_beside_the_learner_and_other_machines_are_servers():
    """Ranks 1..num_actors on the learner's machine (world 1 + num_actors); num_actors=0
    and async actors on several nodes are one line each: other machines run servers."""
    import pytest

    from rlctl.config import validate
    from rlctl.errors import ConfigError
    from rlctl.rollout.layout import ActorLayout

    cfg = compose(["trainer.async_rollout.enabled=true", "trainer.async_rollout.num_actors=2"]).cfg
    assert ActorLayout.from_config(cfg).world_size == 3
    with pytest.raises(ConfigError, match="num_actors"):
        validate(compose(["trainer.async_rollout.enabled=true", "trainer.async_rollout.num_actors=0"]).cfg)
    with pytest.raises(ConfigError, match=r"rollout.engine=server rollout.server.urls=\[http://NODE:PORT"):
        validate(compose(["trainer.async_rollout.enabled=true", "hardware.nnodes=2"]).cfg)
    validate(compose(["hardware.nnodes=2"]).cfg)               # data-parallel nodes: still fine


def test_lost_peer_messages_name_the_rank_and_the_timeout():
    """gloo's own texts (copied from torch 2.13 runs: an irecv whose peer never sent within
    the group's timeout, and one whose peer exited) become a few words; an actor is named
    by its rank everywhere (actor index a is rank a + 1)."""
    from types import SimpleNamespace

    from rlctl.rollout.actors import AsyncSource
    from rlctl.rollout.layout import ActorLayout
    from rlctl.rollout.wire import gloo_reason

    timed_out = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                             "Timed out waiting 2000ms for recv operation to complete")
    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                          "closed by peer [127.0.0.1]:18657. This is typically caused by a remote worker "
                          "crashing. Check the logs of the remote worker before reporting an error. GLHF! x")
    layout = ActorLayout(enabled=True, num_actors=1)
    assert gloo_reason(timed_out, layout.timeout_text()) == "did not answer within the process group's timeout"
    assert gloo_reason(closed) == "exited unexpectedly (Connection closed by peer [127.0.0.1]:18657)"
    source = SimpleNamespace(layout=layout, failed=set(), timeout=layout.timeout_text(), _name=None)
    source._name = lambda a: AsyncSource._name(source, a)
    assert str(AsyncSource._lost(source, 0, timed_out)) == \
        "lost contact with rollout actor rank 1: it did not answer within the process group's timeout"
    assert source.failed == {0}