"""Rollout sources: local (synchronous) and an asynchronous actor process.

``AsyncSource`` starts ONE actor process (torch.multiprocessing, spawn) joined to the
learner in a 2-rank gloo process group (``file://`` rendezvous in a temp dir); the
learner is rank 0, the actor rank 1. The learner drives a request/reply protocol:

  learner -> actor: header [go, with_weights, weights_version, use_rng, B]
                    (with_weights: dist.broadcast of the flattened policy parameters)
                    example indices [B] long; (use_rng) torch RNG state [S] uint8
  actor -> learner: header [version, N, L, P, T, reward_errors, actor_wait_s, rng]
                    input_ids [N, L], attention_mask [N, L], mask [N, T], truncated [N],
                    rewards [N], behaviour log-probs [N, T]; (use_rng) RNG state [S]

Versions count learner steps. A request is sent ahead of the update (overlapping the
actor's generation with the learner's update) only when the rollout will then be at
most ``max_staleness`` steps old; weights travel every ``sync_every`` steps, or sooner
when staleness would exceed the bound. With ``max_staleness=0`` every request follows
the update, carries the newest weights and the learner's RNG state (the actor returns
it advanced): the loop is the synchronous one, bit for bit. A rollout made with the
current weights is on-policy and gets no correction; a stale one keeps the behaviour
policy's log-probs (``old_logprobs``: the PPO-clipped ratio is taken against them).
"""
from __future__ import annotations

import datetime
import os
import tempfile
import time
from typing import Dict, List

import torch

from rlctl.types import RolloutBatch

HEADER = 8


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


def _send(*tensors: torch.Tensor, dst: int) -> None:
    import torch.distributed as dist
    for t in tensors:
        dist.send(t.contiguous(), dst)


def _recv(shape, dtype, src: int) -> torch.Tensor:
    import torch.distributed as dist
    t = torch.empty(shape, dtype=dtype)
    dist.recv(t, src)
    return t


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
        self.version, self.actor_version, self.pending = 0, -(1 << 30), None
        self.stats: Dict[str, List[float]] = {}
        self.dir = tempfile.mkdtemp(prefix="rlctl-async-")
        init = f"file://{os.path.join(self.dir, 'rendezvous')}"
        cfg_yaml = OmegaConf.to_yaml(trainer.cfg, resolve=True)
        # not a daemon: the actor forks its own reward worker (task.reward_timeout_s)
        self.proc = mp.get_context("spawn").Process(target=actor_main, args=(cfg_yaml, init), daemon=False)
        self.proc.start()
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=300))

    # ---- learner side ------------------------------------------------------------
    def _request(self, prefetch: bool) -> None:
        t = self.t
        consumed_at = self.version + (1 if prefetch else 0)
        weights = (self.version - self.actor_version >= self.sync_every
                   or consumed_at - self.actor_version > self.max_stale)
        use_rng = not prefetch
        idx = torch.tensor([t.sampler.randrange(len(t.train_examples)) for _ in range(t.local_prompts)])
        _send(torch.tensor([1, weights, self.version, use_rng, idx.numel(), 0, 0, 0], dtype=torch.float64), dst=1)
        if weights:
            import torch.distributed as dist
            dist.broadcast(flat_params(t.policy), src=0)
            self.actor_version = self.version
        _send(idx, dst=1)
        if use_rng:
            _send(torch.get_rng_state(), dst=1)
        self.pending = (idx, use_rng)

    def _receive(self) -> RolloutBatch:
        idx, use_rng = self.pending
        self.pending = None
        t0 = time.perf_counter()
        h = _recv((HEADER,), torch.float64, 1).tolist()
        version, N, L, P, T = (int(x) for x in h[:5])
        ids = _recv((N, L), torch.long, 1)                             # [N, P+T]
        attn = _recv((N, L), torch.long, 1)                            # [N, P+T]
        mask = _recv((N, T), torch.float32, 1)                         # [N, T]
        truncated = _recv((N,), torch.uint8, 1).bool()                 # [N]
        rewards = _recv((N,), torch.float32, 1)                        # [N]
        behaviour = _recv((N, T), torch.float32, 1)                    # [N, T]
        if use_rng:
            torch.set_rng_state(_recv(torch.get_rng_state().shape, torch.uint8, 1))
        self._log("time/learner_wait_s", time.perf_counter() - t0)
        self._log("time/actor_wait_s", h[6])
        self.t.scorer.errors += int(h[5])
        stale = self.version - version
        self._log("async/staleness", float(stale))
        G = self.t.cfg.algo.group_size
        examples = [self.t.train_examples[i] for i in idx.tolist()]
        dev = self.t.backend.device
        return RolloutBatch(
            input_ids=ids.to(dev), attention_mask=attn.to(dev), mask=mask.to(dev),
            truncated=truncated.to(dev), rewards=rewards.to(dev),
            group_ids=torch.arange(len(examples), device=dev).repeat_interleave(G),
            prompt_len=P, group_size=G, prompts=[e.prompt for e in examples for _ in range(G)],
            completions=[""] * N, old_logprobs=behaviour.to(dev) if stale > 0 else None)

    def sample(self, num_groups: int) -> RolloutBatch:
        if self.pending is None:
            self._request(prefetch=False)
        batch = self._receive()
        if self.max_stale >= 1:              # overlap: the next rollout is made during the update
            self._request(prefetch=True)
        return batch

    def after_update(self) -> None:
        self.version += 1

    def metrics(self) -> Dict[str, float]:
        out = {k: (max(v) if k == "async/staleness" else sum(v)) for k, v in self.stats.items()}
        self.stats = {}
        return out

    def _log(self, key: str, value: float) -> None:
        self.stats.setdefault(key, []).append(value)

    def close(self) -> None:
        import torch.distributed as dist
        try:
            if self.pending is not None:
                self._receive()
            _send(torch.zeros(HEADER, dtype=torch.float64), dst=1)
            self.proc.join(timeout=30)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()


# ---- actor side --------------------------------------------------------------------
def actor_main(cfg_yaml: str, init: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from rlctl.engine.run import _build_model, _build_task, _quiet_libraries
    from rlctl.tasks.scoring import RewardScorer
    from rlctl.rollout.generate import rollout

    cfg = OmegaConf.create(cfg_yaml)
    _quiet_libraries(cfg)
    task = _build_task(cfg)
    model, _, tok, _ = _build_model(cfg)
    model.eval()
    scorer, examples, ro = RewardScorer(task), task.train_examples(), cfg.rollout
    dist.init_process_group("gloo", init_method=init, rank=1, world_size=2)
    version = -1
    try:
        while True:
            t0 = time.perf_counter()
            go, weights, wver, use_rng, B = (int(x) for x in _recv((HEADER,), torch.float64, 0)[:5].tolist())
            if not go:
                break
            if weights:
                flat = flat_params(model)
                dist.broadcast(flat, src=0)
                torch.nn.utils.vector_to_parameters(flat, list(model.parameters()))
                version = wver
            idx = _recv((B,), torch.long, 0)
            if use_rng:
                torch.set_rng_state(_recv(torch.get_rng_state().shape, torch.uint8, 0))
            waited = time.perf_counter() - t0
            errors0 = scorer.errors
            b = rollout(model, tok, [examples[i] for i in idx.tolist()], cfg.algo.group_size,
                        ro.max_new_tokens, ro.temperature, ro.top_k, scorer.score_batch,
                        behaviour_logprobs=True)
            logp = b.old_logprobs                 # [N, T] from generation's own logits
            N, T = b.mask.shape
            _send(torch.tensor([version, N, b.input_ids.shape[1], b.prompt_len, T,
                                scorer.errors - errors0, waited, 0], dtype=torch.float64), dst=0)
            _send(b.input_ids.cpu(), b.attention_mask.long().cpu(), b.mask.float().cpu(),
                  b.truncated.to(torch.uint8).cpu(), b.rewards.float().cpu(), logp.float().cpu(), dst=0)
            if use_rng:
                _send(torch.get_rng_state(), dst=0)
    finally:
        scorer.close()
        dist.destroy_process_group()
