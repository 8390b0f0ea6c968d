"""Rollout sources: local (synchronous) and asynchronous actor processes.

``AsyncSource`` starts ``trainer.async.num_actors`` actor processes (torch.multiprocessing,
spawn) joined to the learner in one gloo process group (``file://`` rendezvous in a temp
dir); the learner is rank 0, actor a is rank a+1. Point-to-point messages, each a fixed
float64 header followed by one byte payload (rlctl/engine/wire.py):

  learner -> actor: [go, with_weights, weights_version, use_rng, B, payload bytes]
                    payload: (with_weights) flat policy parameters, example indices [B],
                    (use_rng) the learner's torch RNG state
  actor -> learner: [version | error code, N, L, P, T, reward_errors, actor_wait_s, bytes]
                    payload: input_ids [N, L], attention_mask [N, L], mask [N, T],
                    truncated [N], rewards [N], behaviour log-probs [N, T], (use_rng)
                    the advanced RNG state, each named reward's sum over the rows
                    (``_named_rewards``); or an error message

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
"""
from __future__ import annotations

import collections
import datetime
import os
import tempfile
import time
from typing import Dict, List

import torch

from rlctl.engine.wire import Posted, Sent, pack, recv_message, send_message, unpack

from rlctl.errors import ActorFailed, RewardError
from rlctl.types import RolloutBatch

USER_ERROR, ACTOR_ERROR = -2, -3


class LocalSource:
    """The synchronous loop: the trainer samples with its own weights."""

    def __init__(self, trainer):
        self.sample = trainer._sample

    def after_update(self) -> None:
        pass

    def metrics(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def flat_params(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector([p.detach().float().cpu() for p in model.parameters()])


class AsyncSource:
    def __init__(self, trainer):
        import torch.distributed as dist
        import torch.multiprocessing as mp
        from omegaconf import OmegaConf

        if trainer.backend.world_size > 1 or dist.is_initialized():
            raise ValueError("trainer.async.enabled=true needs hardware.num_processes=1")
        acfg = trainer.cfg.trainer["async"]
        self.t, self.max_stale, self.sync_every = trainer, int(acfg.max_staleness), int(acfg.sync_every)
        self.num_actors = int(acfg.num_actors)
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
        self.dir = tempfile.mkdtemp(prefix="rlctl-async-")
        init = f"file://{os.path.join(self.dir, 'rendezvous')}"
        cfg_yaml = OmegaConf.to_yaml(trainer.cfg, resolve=True)
        ctx = mp.get_context("spawn")
        # not daemons: an actor forks its own reward worker (task.reward_timeout_s)
        self.procs = [ctx.Process(target=actor_main, args=(cfg_yaml, init, a + 1, self.num_actors + 1),
                                  daemon=False) for a in range(self.num_actors)]
        for p in self.procs:
            p.start()
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=self.num_actors + 1,
                                timeout=datetime.timedelta(seconds=300))

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
        t = self.t
        oldest_allowed = consumed_at - self.max_stale    # weights version the rollout needs
        weights = (self.version - self.actor_version[actor] >= self.sync_every
                   or self.actor_version[actor] < oldest_allowed)
        use_rng = self.max_stale == 0
        idx = torch.tensor([t.sampler.randrange(len(t.train_examples)) for _ in range(t.local_prompts)])
        parts = ([flat_params(t.policy)] if weights else []) + [idx] + ([torch.get_rng_state()] if use_rng else [])
        if actor in self.sent:           # long done: the actor has answered it
            self.sent.pop(actor).wait()
        # sent in the background, and the reply's header receive posted at once: both
        # transfers overlap the learner's update
        self.sent[actor] = Sent([1, weights, self.version, use_rng, idx.numel()], pack(parts), dst=actor + 1)
        if weights:
            self.actor_version[actor] = self.version
        self.pending.append((actor, idx, use_rng, Posted(actor + 1)))

    def _receive(self) -> RolloutBatch:
        actor, idx, use_rng, posted = self.pending.popleft()
        t0 = time.perf_counter()
        h, payload = posted.finish()
        self.idle.append(actor)
        if h[0] in (USER_ERROR, ACTOR_ERROR):
            self.failed.add(actor)
            msg = bytes(payload.tolist()).decode("utf-8", "replace")
            raise (RewardError(msg) if h[0] == USER_ERROR else ActorFailed(f"rollout actor {actor}: {msg}"))
        version, N, L, P, T = (int(x) for x in h[:5])
        specs = [((N, L), torch.long), ((N, T), torch.float32), ((N,), torch.float32),
                 ((N, T), torch.float32), ((N, L), torch.uint8), ((N,), torch.uint8)]
        if use_rng:
            specs.append((torch.get_rng_state().shape, torch.uint8))
        K, M = payload[-16:].clone().view(torch.int64).tolist()       # the named rewards' tail
        specs += [((K,), torch.float64), ((M,), torch.uint8), ((2,), torch.int64)]
        ids, mask, rewards, behaviour, attn, truncated, *rest = unpack(payload, specs)
        if use_rng:
            torch.set_rng_state(rest[0])
        names = bytes(rest[-2].tolist()).decode().split("\n") if K else []
        for name, total in zip(names, rest[-3].tolist()):   # summed as RewardScorer sums them
            self.reward_sums[name] = self.reward_sums.get(name, 0.0) + total
        self.reward_count += N
        self._log("time/learner_wait_s", time.perf_counter() - t0)
        self._log("time/actor_wait_s", h[6])
        self.t.scorer.errors += int(h[5])
        self.t.scorer.calls += N            # the actor scored the N rows it sent
        stale = self.version - version
        self._log("async/staleness", float(stale))
        G = self.t.cfg.algo.group_size
        examples = [self.t.train_examples[i] for i in idx.tolist()]
        dev = self.t.backend.device
        return RolloutBatch(
            input_ids=ids.to(dev), attention_mask=attn.long().to(dev), mask=mask.to(dev),
            truncated=truncated.bool().to(dev), rewards=rewards.to(dev),
            group_ids=torch.arange(len(examples), device=dev).repeat_interleave(G),
            prompt_len=P, group_size=G, prompts=[e.prompt for e in examples for _ in range(G)],
            completions=[""] * N, old_logprobs=behaviour.to(dev) if stale > 0 else None)

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
        import torch.distributed as dist
        try:
            while self.pending:
                self.pending.popleft()[-1].finish()
            for sent in self.sent.values():
                sent.wait()
            for a, p in enumerate(self.procs):
                if p.is_alive() and a not in self.failed:
                    send_message([0], pack([]), dst=a + 1)
            for p in self.procs:
                p.join(timeout=30)
        except (ActorFailed, RuntimeError):
            pass                 # an actor already gone: terminated below
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()


# ---- actor side --------------------------------------------------------------------
def _send_rollout(b: RolloutBatch, info: List[float], use_rng: bool,
                  components: Dict[str, List[float]]) -> None:
    """The reply to the learner; ``info``: [weights version, reward errors, wait s]."""
    N, T = b.mask.shape
    parts = [b.input_ids, b.mask.float(), b.rewards.float(), b.old_logprobs.float(),
             b.attention_mask.to(torch.uint8), b.truncated.to(torch.uint8)]
    if use_rng:
        parts.append(torch.get_rng_state())
    parts += _named_rewards(components)
    version, errors, waited = info
    send_message([version, N, b.input_ids.shape[1], b.prompt_len, T, errors, waited],
                 pack([x.cpu() for x in parts]), dst=0)


def _named_rewards(components: Dict[str, List[float]]) -> List[torch.Tensor]:
    """The payload's tail: each named reward's sum over the rows [K] float64, the names
    ("\n"-joined utf-8) [M] uint8, then (K, M) int64, so the learner reads it from the end."""
    names = sorted(components)
    text = torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8)
    return [torch.tensor([sum(components[k]) for k in names], dtype=torch.float64), text,
            torch.tensor([len(names), text.numel()], dtype=torch.int64)]


def actor_main(cfg_yaml: str, init: str, rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from rlctl.engine.build import model_from_config, task_from_config, quiet_libraries
    from rlctl.errors import UserError
    from rlctl.rollout.generate import rollout
    from rlctl.tasks.scoring import RewardScorer

    os.setpgrp()   # a terminal's Ctrl-C or `timeout` signals the learner, which stops at a step
    cfg = OmegaConf.create(cfg_yaml)
    quiet_libraries(cfg)
    task = task_from_config(cfg)
    model, _, tok, _ = model_from_config(cfg)
    model.eval()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    scorer, examples, ro = RewardScorer(task), task.train_examples(), cfg.rollout
    torch.manual_seed(cfg.seed * 1000 + 7919 * rank)      # each actor its own sampling stream
    # The learner is the bottleneck: when the cores are oversubscribed (reward workers,
    # gloo threads) it keeps its core. Measured: 31.1-31.7 vs 28-31 async steps/s.
    os.nice(5)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    version = -1
    try:
        while True:
            t0 = time.perf_counter()
            h, payload = recv_message(src=0)
            go, weights, wver, use_rng, B = (int(x) for x in h[:5])
            if not go:
                break
            waited = time.perf_counter() - t0
            specs = ([((n_params,), torch.float32)] if weights else []) + [((B,), torch.long)]
            if use_rng:
                specs.append((torch.get_rng_state().shape, torch.uint8))
            fields = unpack(payload, specs)
            if weights:
                torch.nn.utils.vector_to_parameters(fields.pop(0), params)
                version = wver
            idx = fields[0]
            if use_rng:
                torch.set_rng_state(fields[1])
            errors0 = scorer.errors
            try:
                b = rollout(model, tok, [examples[i] for i in idx.tolist()], cfg.algo.group_size,
                            ro.max_new_tokens, ro.temperature, ro.top_k, scorer.score_batch,
                            behaviour_logprobs=True,      # old_logprobs from generate's own logits
                            share_prompts=cfg.trainer.share_prompts)
            except Exception as exc:  # noqa: BLE001 - reported to the learner, which stops
                code = USER_ERROR if isinstance(exc, UserError) else ACTOR_ERROR
                text = str(exc) if code == USER_ERROR else f"{type(exc).__name__}: {exc}"
                send_message([code], torch.tensor(list(text.encode()), dtype=torch.uint8), dst=0)
                break
            _send_rollout(b, [version, scorer.errors - errors0, waited], use_rng,
                          scorer.last_components)
    finally:
        scorer.close()
        dist.destroy_process_group()
