"""The asynchronous rollout source: the learner's side and the actor processes' serving loop.

``AsyncSource`` starts ``trainer.async_rollout.num_actors`` actor processes (torch.multiprocessing,
spawn) joined to the learner in one gloo process group (``file://`` rendezvous in a temp
dir); the learner is rank 0, actor a is rank a+1. Rollout on other machines is done by
inference servers (``rollout.engine=server``: rlctl/rollout/engine_source.py), which
bench/engines.py measured slower than these actors on one machine (HTTP and JSON per row).
Point-to-point messages, each a fixed float64 header and one byte payload (wire.py):

  learner -> actor: [go, with_weights, weights_version, use_rng, B, seed, payload bytes]
                    payload: (with_weights) flat policy parameters, example indices [B],
                    (use_rng) the learner's torch RNG state; stop: [0, learner failed].
                    seed: the environments' seed of an episodic task (else 0)
  actor -> learner: [version | error code, N, L, P, T, reward_errors, actor_wait_s, bytes]
                    payload: the batch's ``WIRE`` fields (input_ids [N, L],
                    attention_mask [N, L], mask [N, T], truncated [N], rewards [N],
                    behaviour log-probs [N, T]), (use_rng)
                    the advanced RNG state, (episodes) token_rewards [N, T] and the
                    episodes' JSON text (rlctl/rollout/episode_wire.py), each named
                    reward of each row (``_named_rewards``); or an error message

An episodic task (``local`` an ``EpisodeSource``): the actor plays the requested rows as
episodes (its ``player``) with its copy of the weights and the learner's seed; the
learner keeps the behaviour log-probs of every rollout, stale or not, as the
synchronous episode source does (so ``max_staleness=0`` is still that loop bit for bit).

Versions count learner updates. Rollouts are requested in the order the learner will
consume them. A step consumes one rollout, or several with dynamic sampling (DAPO), so
a rollout requested ahead is consumed at the latest when every rollout before it takes a
step of its own: with k rollouts pending, at version + k (+ 1 once the current step has
taken one). It is requested ahead only while that latest version is within
``max_staleness`` of the weights it is made with, so at most ``min(num_actors,
max_staleness)`` rollouts are made while the learner updates; a step that needs another
rollout when none is pending (an extra sampling round) asks for one at once, made with
weights at most ``max_staleness`` updates old. Weights travel with a request when the
actor's copy is ``sync_every`` updates old, or sooner when the staleness bound needs
them. With
``max_staleness=0`` every request follows the update, carries the newest weights and the
learner's RNG state (the actor returns it advanced): the loop is the synchronous one, bit
for bit. A rollout made with the current weights is on-policy and gets no correction; a
stale one keeps the behaviour policy's log-probs (``old_logprobs``: the PPO-clipped ratio
is taken against them).

The config is read elsewhere, once: ``ActorSettings`` (the request queue) and
``ActorLayout`` (rlctl/rollout/layout.py: where each rank lives) come from it, and the
actor processes' entry point (built with the learner's whole config, sent as YAML text
this module never reads) is handed in by the run (rlctl/run/rollout_setup.py).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlctl.errors import ActorFailed, RewardError, UserError
from rlctl.rollout.generate import rollout
from rlctl.rollout.episode_wire import episode_text, episodes_of
from rlctl.rollout.layout import ActorLayout
from rlctl.rollout.source import LocalSource
from rlctl.rollout.wire import Posted, Sent, gloo_reason, pack, recv_message, send_message, unpack
from rlctl.types import COMPLETION, ROW, RolloutBatch

USER_ERROR, ACTOR_ERROR = -2, -3
# The batch fields an actor sends: name -> (dtype on the wire, dtype in the batch).
WIRE = {"input_ids": (torch.long, torch.long), "attention_mask": (torch.uint8, torch.long),
        "mask": (torch.float32, torch.float32), "truncated": (torch.uint8, torch.bool),
        "rewards": (torch.float32, torch.float32), "old_logprobs": (torch.float32, torch.float32)}


@dataclass(frozen=True)
class ActorSettings:
    """The ``trainer`` fields the asynchronous source's requests read."""
    max_staleness: int             # updates a rollout may be behind when consumed
    sync_every: int                # updates between weight syncs to an actor
    prompts_per_step: int          # B prompts per request (one learner process)

    @classmethod
    def from_config(cls, cfg) -> "ActorSettings":
        """From the composed config's ``trainer`` and ``trainer.async_rollout`` sections."""
        a = cfg.trainer.async_rollout
        return cls(max_staleness=int(a.max_staleness), sync_every=int(a.sync_every),
                   prompts_per_step=int(cfg.trainer.prompts_per_step))


def flat_params(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector([p.detach().float().cpu() for p in model.parameters()])


class AsyncSource:
    """Rollouts from actor processes; prompts drawn, and rewards counted, by ``local``
    (its sampler, examples and scorer), weights read from its policy module. The local
    actors run ``actor_main(cfg_yaml, init, rank, world)``: ``cfg_yaml``, the learner's
    resolved config as text, goes to them unread."""

    def __init__(self, settings: ActorSettings, layout: ActorLayout, local: LocalSource, device,
                 actor_main: Callable, cfg_yaml: str, stop=None):
        self.local, self.device, self.group_size = local, device, local.settings.group_size
        self.sampler, self.scorer, self.settings = local.sampler, local.scorer, local.settings
        self.player = getattr(local, "player", None)     # episodic: the learner's eval plays with it
        self.num_prompts = settings.prompts_per_step            # one learner process
        self.max_stale, self.sync_every = settings.max_staleness, settings.sync_every
        self.layout, self.timeout = layout, layout.timeout_text()
        self.num_actors = layout.num_actors
        self.version = 0                                  # updates done
        self.took = False                                 # the current step consumed a rollout
        self.actor_version = [-(1 << 30)] * self.num_actors
        self.idle = collections.deque(range(self.num_actors))
        self.failed: set = set()                          # actors that reported an error
        self.pending: collections.deque = collections.deque()   # (actor, indices, use_rng, Posted)
        self.sent: Dict[int, Sent] = {}                   # the last request to each actor
        self.stats: Dict[str, List[float]] = {}
        self.reward_sums: Dict[str, float] = {}           # named rewards (sorting: each design)
        self.reward_count = 0
        self._start(actor_main, cfg_yaml, stop)

    def _start(self, actor_main: Callable, cfg_yaml: str, stop) -> None:
        """Spawn the actors and form the group (``file://`` rendezvous in a temp dir)."""
        world = self.num_actors + 1
        self.rendezvous_dir = tempfile.mkdtemp(prefix="rlctl-async-")      # removed by close
        init = f"file://{os.path.join(self.rendezvous_dir, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        # not daemons: an actor forks its own reward worker (task.reward_timeout_s)
        self.procs = [ctx.Process(target=actor_main, args=(cfg_yaml, init, a + 1, world), daemon=False)
                      for a in range(self.layout.num_actors)]
        for p in self.procs:
            p.start()
        try:
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=world,
                                    timeout=datetime.timedelta(seconds=300))
        except BaseException:
            for p in self.procs:
                p.terminate()
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            raise

    def _lost(self, actor: int, exc: BaseException) -> ActorFailed:
        """An actor whose transfer failed: it exited."""
        self.failed.add(actor)
        return ActorFailed(f"lost contact with {self._name(actor)}: it "
                           f"{gloo_reason(exc.__cause__ or exc, self.timeout)}")

    def _name(self, actor: int) -> str:             # "rollout actor rank 1"
        return f"rollout actor rank {actor + 1}"

    # ---- learner side ------------------------------------------------------------
    def _fill(self) -> None:
        """Request rollouts ahead, in consumption order, while an actor is idle and the
        next one would be at most ``max_staleness`` updates old when consumed."""
        while self.idle:
            latest = self.version + len(self.pending) + int(self.took)   # consumed by then
            if latest - self.version > self.max_stale:
                break
            self._request(self.idle.popleft(), latest)

    def _request(self, actor: int, consumed_at: int) -> None:
        """Ask ``actor`` for a rollout the learner consumes at version ``consumed_at`` at
        the latest; its weights must then be at most ``max_staleness`` updates old."""
        oldest_allowed = consumed_at - self.max_stale    # weights version the rollout needs
        weights = (self.version - self.actor_version[actor] >= self.sync_every
                   or self.actor_version[actor] < oldest_allowed)
        use_rng = self.max_stale == 0
        idx = torch.tensor(self.local.draw(self.num_prompts))
        seed = self.local.draw_seed() if self.player is not None else 0   # after the rows, as in sync
        parts = ([flat_params(self.local.policy)] if weights else []) + [idx] + \
            ([torch.get_rng_state()] if use_rng else [])
        try:
            if actor in self.sent:           # long done: the actor has answered it
                self.sent.pop(actor).wait()
            # sent in the background, and the reply's header receive posted at once: both
            # transfers overlap the learner's update
            self.sent[actor] = Sent([1, weights, self.version, use_rng, idx.numel(), seed],
                                    pack(parts), dst=actor + 1)
            posted = Posted(actor + 1)
        except RuntimeError as exc:
            raise self._lost(actor, exc) from None
        if weights:
            self.actor_version[actor] = self.version
        self.pending.append((actor, idx, use_rng, posted))

    def _receive(self) -> RolloutBatch:
        actor, idx, use_rng, posted = self.pending.popleft()
        t0 = time.perf_counter()
        try:
            h, payload = posted.finish()
        except ActorFailed as exc:
            raise self._lost(actor, exc) from None
        self.idle.append(actor)
        if h[0] in (USER_ERROR, ACTOR_ERROR):
            self.failed.add(actor)
            msg = bytes(payload.tolist()).decode("utf-8", "replace")
            raise (RewardError(msg) if h[0] == USER_ERROR else ActorFailed(f"{self._name(actor)}: {msg}"))
        version, N, L, P, T = (int(x) for x in h[:5])
        dims = {ROW: (N,), COMPLETION: (N, T)}
        specs = [(dims.get(RolloutBatch.axis(k), (N, L)), wire) for k, (wire, _) in WIRE.items()]
        if use_rng:
            specs.append((torch.get_rng_state().shape, torch.uint8))
        K, M, E = payload[-24:].clone().view(torch.int64).tolist()    # the tail's sizes
        if E:                # episodes: token_rewards [N, T] and their JSON text
            specs += [((N, T), torch.float32), ((E,), torch.uint8)]
        specs += [((K * N,), torch.float64), ((M,), torch.uint8), ((3,), torch.int64)]
        parts = unpack(payload, specs)
        if use_rng:
            torch.set_rng_state(parts[len(WIRE)])
        named = self._count(N, parts[-3], parts[-2], h, time.perf_counter() - t0, scored=not E)
        stale = self.version - version
        self._log("async/staleness", float(stale))
        G, dev = self.group_size, self.device
        fields = {k: x.to(dev, batch_dtype) for (k, (_, batch_dtype)), x in zip(WIRE.items(), parts)}
        fields["engine_logprobs"] = fields["old_logprobs"] * fields["mask"]   # the sampler's, kept apart
        if stale == 0 and not E:   # on-policy: no correction, the learner's pi_old serves
            fields["old_logprobs"] = None
        prompts = [self.local.examples[i].prompt for i in idx.tolist() for _ in range(G)]
        completions, episodes, token_rewards = [""] * N, None, None
        if E:
            episodes, prompts, completions = episodes_of(parts[-4])
            token_rewards = parts[-5].to(dev)
        return RolloutBatch(**fields, group_ids=torch.arange(N // G, device=dev).repeat_interleave(G),
                            prompt_len=P, group_size=G, prompts=prompts, completions=completions,
                            staleness=torch.full((N,), stale, dtype=torch.long, device=dev),
                            reward_parts=named, token_rewards=token_rewards, episodes=episodes)

    def _count(self, N: int, values: torch.Tensor, names: torch.Tensor, h,
               waited: float, scored: bool = True) -> Dict[str, List[float]]:
        """Book a reply: named reward sums, reward errors and calls (``scored``: the
        actor scored its rows; episodes take their rewards from their environments),
        the waits. Returns each named reward's N values (``values``: [K * N], name by name)."""
        keys = bytes(names.tolist()).decode().split("\n") if values.numel() else []
        named = dict(zip(keys, values.view(len(keys), N).tolist())) if keys else {}
        for name, row in named.items():     # summed as RewardScorer sums them
            self.reward_sums[name] = self.reward_sums.get(name, 0.0) + sum(row)
        self.reward_count += N
        self._log("time/learner_wait_s", waited)
        self._log("time/actor_wait_s", h[6])
        self.scorer.errors += int(h[5])
        self.scorer.calls += N if scored else 0     # the actor scored the N rows it sent
        return named

    def sample(self, num_groups: int) -> RolloutBatch:
        self._fill()
        if not self.pending:     # another round within this step: consumed right away
            self._request(self.idle.popleft(), self.version)
        batch = self._receive()
        self.took = True
        self._fill()             # overlap: the freed actor starts the next rollout now
        return batch

    def after_update(self) -> None:
        self.version += 1
        self.took = False

    def metrics(self) -> Dict[str, float]:
        """Staleness (max), waits (sums) and each named reward's mean over the rows the
        actors scored since the last call, as ``RewardScorer.metrics`` gives it in sync."""
        out = {k: (max(v) if k == "async/staleness" else sum(v)) for k, v in self.stats.items()}
        out.update({f"reward/{k}": v / max(self.reward_count, 1) for k, v in self.reward_sums.items()})
        self.stats, self.reward_sums, self.reward_count = {}, {}, 0
        return out

    def _log(self, key: str, value: float) -> None:
        self.stats.setdefault(key, []).append(value)

    def close(self) -> None:
        """Stop every actor still there (telling them whether the learner failed: called
        while an exception propagates), then end the group."""
        failed = int(sys.exc_info()[0] is not None)
        gone = contextlib.suppress(ActorFailed, RuntimeError)   # an actor already gone: no error
        try:
            for *_, posted in self.pending:
                with gone:
                    posted.finish()
            for sent in self.sent.values():
                with gone:
                    sent.wait()
            for a in range(self.num_actors):
                if a not in self.failed and (a >= len(self.procs) or self.procs[a].is_alive()):
                    with gone:
                        send_message([0, failed], pack([]), dst=a + 1)
            for p in self.procs:
                p.join(timeout=30)
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.local.close()


# ---- actor side --------------------------------------------------------------------
def _send_rollout(b: RolloutBatch, info: List[float], use_rng: bool,
                  components: Dict[str, List[float]]) -> None:
    """The reply to the learner; ``info``: [weights version, reward errors, wait s]."""
    N, T = b.mask.shape
    parts = [getattr(b, k).to(wire) for k, (wire, _) in WIRE.items()]
    if use_rng:
        parts.append(torch.get_rng_state())
    text = episode_text(b) if b.episodes is not None else torch.empty(0, dtype=torch.uint8)
    if text.numel():
        parts += [b.token_rewards.to(torch.float32), text]
    parts += _named_rewards(components, text.numel())
    version, errors, waited = info
    send_message([version, N, b.input_ids.shape[1], b.prompt_len, T, errors, waited],
                 pack([x.cpu() for x in parts]), dst=0)


def _named_rewards(components: Dict[str, List[float]], episode_bytes: int) -> List[torch.Tensor]:
    """The payload's tail: each named reward of each row [K * N] float64 (name by name),
    the names ("\n"-joined utf-8) [M] uint8, then (K, M, E) int64 (E: the episodes' JSON
    bytes before them, 0 for single-turn rows), so the learner reads it from the end."""
    names = sorted(components)
    text = torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8)
    return [torch.tensor([v for k in names for v in components[k]], dtype=torch.float64), text,
            torch.tensor([len(names), text.numel(), episode_bytes], dtype=torch.int64)]


def serve_learner(actor: LocalSource, init: str, rank: int, world_size: int, layout: ActorLayout) -> str:
    """An actor process, its ``actor`` built: join the group (``file://``), serve; returns
    what went wrong ("" after a normal stop)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        return _serve(actor, layout.timeout_text())
    finally:
        actor.scorer.close()
        dist.destroy_process_group()


def _serve(actor: LocalSource, timeout: str) -> str:
    """Answer the learner's requests until it says stop (or a rollout fails); returns
    what went wrong ("" after a normal stop). ``timeout``: the group's, in words."""
    params = list(actor.policy.parameters())
    n_params, version = sum(p.numel() for p in params), -1
    while True:
        t0 = time.perf_counter()
        h, payload = _with_learner(timeout, recv_message, 0)
        go, weights, wver, use_rng, B, seed = (int(x) for x in h[:6])
        if not go:
            return "the learner ended its run early (it says why)" if h[1] else ""
        waited = time.perf_counter() - t0
        specs = ([((n_params,), torch.float32)] if weights else []) + [((B,), torch.long)]
        if use_rng:
            specs.append((torch.get_rng_state().shape, torch.uint8))
        fields = unpack(payload, specs)
        if weights:
            torch.nn.utils.vector_to_parameters(fields.pop(0), params)
            version = wver
        if use_rng:
            torch.set_rng_state(fields[1])
        errors0 = actor.scorer.errors
        try:
            b = _rollout(actor, fields[0].tolist(), seed)
        except Exception as exc:  # noqa: BLE001 - reported to the learner, which stops
            code = USER_ERROR if isinstance(exc, UserError) else ACTOR_ERROR
            text = str(exc) if code == USER_ERROR else f"{type(exc).__name__}: {exc}"
            send_message([code], torch.tensor(list(text.encode()), dtype=torch.uint8), dst=0)
            return f"{text} (sent to the learner, which stops)"
        _with_learner(timeout, _send_rollout, b, [version, actor.scorer.errors - errors0, waited], use_rng,
                      actor.scorer.last_components)


def _with_learner(timeout: str, transfer, *args):
    """A transfer to or from the learner; its loss (it died) is one line."""
    try:
        return transfer(*args)
    except (ActorFailed, RuntimeError) as exc:
        raise ActorFailed(f"lost contact with the learner (rank 0): it "
                          f"{gloo_reason(exc.__cause__ or exc, timeout)}") from None


def _rollout(actor, indices: List[int], seed: int) -> RolloutBatch:
    """The learner's prompts, sampled with ``old_logprobs`` from generation's own logits;
    for an episodic task (an ``EpisodeSource``), its rows played as episodes with ``seed``."""
    examples = [actor.examples[i] for i in indices]
    if getattr(actor, "player", None) is not None:
        return actor.player.play(actor.policy, examples, seed)
    s = actor.settings
    return rollout(actor.policy, actor.tokenizer, examples, s.group_size,
                   s.max_new_tokens, s.temperature, s.top_k, actor.scorer.score_batch,
                   behaviour_logprobs=True, share_prompts=s.share_prompts,
                   sample_dtype=s.sample_dtype)
