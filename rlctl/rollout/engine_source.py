"""Rollouts from generation engines (rollout/engine.py): remote or loopback servers
(``rollout.engine=server``) or local engine processes (``trainer.async_rollout.enabled``,
rollout/local_engine.py). The learner's prompts go to an engine as token ids, the
completions are scored here and laid out as the learner's ``RolloutBatch``; the learner's
weights are pushed to the engine. An episodic task's rows are played by local engines
(``play``) and come back as batches.

* **Seeds.** Each request draws its prompts and one seed from ``sampler`` (the checkpointed
  prompt RNG), so a run's tokens depend on that seed and the engine's ``chunk_size`` only:
  one server, two servers, or the ``torch`` engine in this process with the same
  ``chunk_size`` give the same tokens (tests/rollout/test_engine_source.py). Local
  engines (``learner_rng``) draw no seed: at max_staleness=0 a request carries the
  learner's torch RNG state and it comes back advanced, so the run is the synchronous
  loop bit for bit; ahead, each engine samples from its own stream.
* **Weights.** The learner's weights go with an engine's first request (the engine then
  holds them, whatever it loaded; a resumed run's are the checkpoint's, loaded after this
  source was built), then a new version after updates: when the engine's copy is
  ``sync_every`` updates old, or sooner when the staleness bound needs it. A LoRA policy
  pushes its adapter only (``policy_weights``). ``weight_dir``: the weights go through
  that directory (``update_weights_from_disk``; servers that see it) instead of the body.
* **Ahead (the staleness controller).** Versions count learner updates. Rollouts are
  requested in the order the learner consumes them, one per idle engine: a step consumes
  one rollout, or several with dynamic sampling, so a rollout requested with k pending is
  consumed at the latest at version + k (+1 once the current step took one). It is
  requested ahead only while that is within ``max_staleness`` of the weights it is made
  with, so at most ``min(engines, max_staleness)`` rollouts are made while the learner
  updates; a step that needs another rollout when none is pending asks for one at once.
  A stale rollout keeps the engine's log-probs as ``old_logprobs`` (the PPO ratio's
  behaviour policy); an on-policy one gets no correction (the learner computes pi_old).
* Versions start one past the engine's version when the source started (servers that
  outlive a run keep their count; the first push is never a version a server may hold
  without it).
"""
from __future__ import annotations

import collections
import random
import shutil
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import save_file

from rlctl.core.logprobs import completion_mask
from rlctl.models.stop_ids import decode_completions, resolve_stop_ids
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.engine import Completion, Sampling, left_padded
from rlctl.rollout.episode_source import SEED_RANGE
from rlctl.rollout.local_engine import moved
from rlctl.rollout.source import SamplingSettings, SyncSource
from rlctl.rollout.weights import KIND_KEY, prune_versions
from rlctl.types import Example, RolloutBatch


@dataclass(frozen=True)
class EngineSettings:
    """How the learner drives its engine (``rollout.*`` and ``trainer.async_rollout.*``)."""
    max_staleness: int = 0          # 0: every request after the update (synchronous)
    sync_every: int = 1             # updates between weight pushes
    weight_dir: Optional[str] = None   # push through this directory (None: HTTP body)

    @classmethod
    def from_config(cls, cfg) -> "EngineSettings":
        a = cfg.trainer.async_rollout
        ahead = bool(a.enabled)
        return cls(max_staleness=int(a.max_staleness) if ahead else 0,
                   sync_every=int(a.sync_every) if ahead else 1,
                   weight_dir=(cfg.rollout.server.weight_dir if cfg.rollout.server.weight_sync == "disk"
                               else None))


def policy_weights(policy) -> Tuple[Dict[str, torch.Tensor], str]:
    """(tensors, kind) the engine needs to serve ``policy``: a peft LoRA policy's adapter
    (rollout/weights.py layout: ``M.lora_A``, ``M.lora_B`` scaled, M named in the base
    model), else every parameter of the language model (no value head). Detached copies
    on the CPU: the learner may change its own right after."""
    model = policy.policy if isinstance(policy, PolicyValueModel) else policy
    if hasattr(model, "peft_config"):
        base = model.get_base_model()
        out = {}
        for name, m in base.named_modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                out[f"{name}.lora_A"] = m.lora_A["default"].weight.detach().cpu().clone()
                out[f"{name}.lora_B"] = (m.lora_B["default"].weight.detach()
                                         * m.scaling["default"]).cpu()        # a new tensor
        return out, "adapter"
    return {k: v.detach().cpu().clone() for k, v in model.named_parameters()}, "full"


class EngineSource(SyncSource):
    """B prompts drawn from ``examples`` by ``sampler``, G completions each from an engine,
    scored by ``scorer``; ``policy``: the module the learner trains (its weights are
    pushed). ``engine``: one engine, or a list of them (local engine processes), each
    making one request at a time. ``learner_rng``: at max_staleness=0 a request carries
    the learner's torch RNG state as its seed, set back advanced when it is consumed (the
    synchronous loop's stream), and ahead requests draw no seed (each engine's own
    stream); else each request draws a seed from ``sampler``. ``player``: an episodic
    task's player; its rows are then played by the engines (``engine.play``).
    ``on_close``: called last by ``close`` (e.g. stop the processes the run started)."""

    def __init__(self, engine, policy, tokenizer, examples: Sequence[Example], scorer,
                 sampling: SamplingSettings, settings: EngineSettings, seed: int,
                 device=None, on_close: Optional[Callable[[], None]] = None,
                 learner_rng: bool = False, player=None):
        self.engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
        self.engine, self.policy, self.tokenizer = self.engines[0], policy, tokenizer
        self.examples, self.scorer, self.settings = list(examples), scorer, settings
        self.sampling, self.learner_rng, self.player = sampling, learner_rng, player
        self.prompt_rng = random.Random(seed)
        self.device = device if device is not None else next(policy.parameters()).device
        self.stops = resolve_stop_ids(policy, tokenizer, sampling.stop_token_ids)
        self.pad_id = int(tokenizer.pad_token_id)
        self.on_close = on_close
        # the learner's weights: one past the engines' count when we started, never equal
        # to what a server holds unpushed (a server restarted unseen reports 0, its own
        # load: with the first push at 0 its rows would pass as the learner's)
        self.version = max(int(getattr(e, "version", 0)) for e in self.engines) + 1
        # each engine's weights version; None: nothing pushed yet. The first request pushes
        # (not this constructor): a resumed run loads its checkpoint's weights after this.
        self.pushed: List[Optional[int]] = [None] * len(self.engines)
        self.idle = collections.deque(range(len(self.engines)))
        self.pending: collections.deque = collections.deque()   # (engine index, Future)
        self.took = False                                  # this step consumed a rollout
        self.stats: Dict[str, List[float]] = {}

    # -- weights -----------------------------------------------------------------------
    def _push(self, engine, snap) -> float:
        """Send ``snap`` (version, tensors, kind) to ``engine``; returns the seconds it took."""
        version, tensors, kind = snap
        t0 = time.perf_counter()
        if self.settings.weight_dir is None:
            engine.update_weights(version, tensors, kind)
        else:
            engine.update_weights_from_disk(version, _write(self.settings.weight_dir, version,
                                                            tensors, kind))
        return time.perf_counter() - t0

    def _needs_push(self, e: int, consumed_at: int) -> bool:
        s, pushed = self.settings, self.pushed[e]
        return pushed is None or self.version - pushed >= s.sync_every or pushed < consumed_at - s.max_staleness

    # -- requests: the staleness controller --------------------------------------------
    def _fill(self, num_groups: int) -> None:
        """Request rollouts ahead, in consumption order, while an engine is idle and the
        next one would be at most ``max_staleness`` updates old when consumed: with k
        pending, it is consumed at version + k (+1 once this step has taken one)."""
        while self.idle:
            latest = self.version + len(self.pending) + int(self.took)
            if latest - self.version > self.settings.max_staleness:
                break
            self._request(self.idle.popleft(), num_groups, latest)

    def _request(self, e: int, num_groups: int, consumed_at: int) -> None:
        """Draw the next request's rows and seed (in this thread, in order), take a weights
        snapshot if engine ``e`` must have newer ones, and start it in a worker thread."""
        engine, rows = self.engines[e], self.draw(num_groups)
        env_seed = self.prompt_rng.randrange(SEED_RANGE) if self.player is not None else None
        if self.learner_rng:
            seed = torch.get_rng_state() if self.settings.max_staleness == 0 else None
        else:
            seed = self.prompt_rng.getrandbits(62)
        snap = None
        if self._needs_push(e, consumed_at):
            tensors, kind = policy_weights(self.policy)
            snap, self.pushed[e] = (self.version, tensors, kind), self.version   # booked now
        examples = [self.examples[i] for i in rows]
        G, s = self.sampling.group_size, self.sampling
        prompts = [] if self.player is not None else \
            [p for ex in examples for p in [self.tokenizer(ex.prompt)["input_ids"]] * G]
        sampling = Sampling(s.max_new_tokens, s.temperature, s.top_k, tuple(self.stops))

        def job():          # runs in the worker thread: it only calls the engine
            push_s = self._push(engine, snap) if snap is not None else 0.0
            t0 = time.perf_counter()
            if self.player is not None:
                outs = engine.play(rows, env_seed, seed)
            else:
                outs = engine.generate(prompts, sampling, seed)
            rng = engine.rng_state if isinstance(seed, torch.Tensor) else None
            return examples, prompts, outs, rng, time.perf_counter() - t0, push_s
        self.pending.append((e, _in_thread(job)))

    def sample(self, num_groups: int) -> RolloutBatch:
        t0 = time.perf_counter()
        self._fill(num_groups)
        if not self.pending:     # another round within this step: made and consumed now
            self._request(self.idle.popleft(), num_groups, self.version)
        e, future = self.pending.popleft()
        examples, prompts, outs, rng, gen_s, push_s = future.result()
        self.idle.append(e)
        if rng is not None:
            torch.set_rng_state(rng)          # the learner's stream, advanced by the engine
        self._log("time/learner_wait_s", time.perf_counter() - t0)
        self._log("time/engine_generate_s", gen_s)
        self._log("time/weight_sync_s", push_s)
        self.took = True
        self._fill(num_groups)   # the freed engine starts the next rollout now
        if self.player is not None:
            return self._episodes(outs)
        return self._batch(examples, prompts, outs)

    def after_update(self) -> None:
        self.version += 1
        self.took = False

    def _episodes(self, batch: RolloutBatch) -> RolloutBatch:
        """An engine's episodes: the behaviour log-probs kept whether stale or not, as the
        synchronous episode source keeps them; ``staleness`` arrives as the weights version."""
        batch = moved(batch, self.device)
        stale = self.version - batch.staleness                                         # [N]
        self._log("async/staleness", float(stale.max()))
        return batch.replace(staleness=stale, engine_logprobs=batch.old_logprobs * batch.mask)

    # -- the batch ---------------------------------------------------------------------
    def _batch(self, examples: List[Example], rows, outs: List[Completion]) -> RolloutBatch:
        """The completions laid out as ``rollout.generate.rollout`` lays out its own."""
        G, dev = self.sampling.group_size, self.device
        prompt_ids, prompt_mask = left_padded(rows, self.pad_id, dev)                # [N, P]
        N, T = len(outs), max(len(c.token_ids) for c in outs)
        comp = torch.full((N, T), self.pad_id, dtype=torch.long)                     # [N, T]
        logp = torch.zeros(N, T, dtype=torch.float32)                                # [N, T]
        for i, c in enumerate(outs):
            comp[i, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            logp[i, :len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float64).float()
        comp, logp = comp.to(dev), logp.to(dev)
        mask, truncated = completion_mask(comp, self.stops, self.pad_id)
        texts = decode_completions(self.tokenizer, comp, mask, self.stops)
        per_row = [examples[i // G] for i in range(N)]
        rewards = torch.tensor(self.scorer.score_batch(per_row, texts), dtype=torch.float32, device=dev)
        stale = torch.tensor([self.version - c.weights_version for c in outs], device=dev)  # [N]
        self._log("async/staleness", float(stale.max()))
        engine_lp = logp * mask                                                       # [N, T]
        return RolloutBatch(
            input_ids=torch.cat([prompt_ids, comp], 1), attention_mask=torch.cat([prompt_mask, mask.long()], 1),
            mask=mask, truncated=truncated, rewards=rewards,
            group_ids=torch.arange(len(examples), device=dev).repeat_interleave(G),
            prompt_len=prompt_ids.shape[1], group_size=G,
            prompts=[ex.prompt for ex in examples for _ in range(G)], completions=texts,
            old_logprobs=engine_lp if bool((stale > 0).any()) else None,
            staleness=stale, engine_logprobs=engine_lp,
            reward_parts=self.scorer.last_components)

    # -- the rest ----------------------------------------------------------------------
    def _log(self, key: str, value: float) -> None:
        self.stats.setdefault(key, []).append(value)

    def metrics(self) -> Dict[str, float]:
        """Staleness (max) and times (sums) since the last call, and how many servers
        are usable (``engine/servers_up``, a server engine only)."""
        out = {k: (max(v) if k == "async/staleness" else sum(v)) for k, v in self.stats.items()}
        servers = getattr(self.engine, "servers", None)
        if servers is not None:
            out["engine/servers_up"] = float(sum(s.up for s in servers))
        self.stats = {}
        return out

    def close(self) -> None:
        """Waits ``CLOSE_WAIT_S`` at most for each request still pending (a hung server
        must not hold the run's exit for its ``timeout_s``), then leaves it to its daemon
        thread."""
        try:
            for e, future in self.pending:
                try:
                    future.result(CLOSE_WAIT_S)
                except FutureTimeout:
                    _quiet(self.engines[e])
                except Exception:  # noqa: BLE001 - nobody reads this request: the run is over
                    pass
            self.pending.clear()
        finally:
            try:
                super().close()
            finally:
                if self.on_close is not None:
                    self.on_close()


CLOSE_WAIT_S = 5.0


def _in_thread(job: Callable[[], tuple]) -> Future:
    """``job()`` in a daemon thread (not an executor's: its threads are joined at exit,
    so a request to a hung server would hold the process up to the request's limit)."""
    future: Future = Future()

    def run():
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - raised where the result is read
                future.set_exception(exc)
    threading.Thread(target=run, name="rlctl-engine", daemon=True).start()
    return future


def _quiet(engine) -> None:
    """A request left behind at close says nothing more (its servers may be stopping)."""
    if hasattr(engine, "say"):
        engine.say = lambda message: None


def _write(root: str, version: int, tensors: Dict[str, torch.Tensor], kind: str) -> str:
    """``root``/v<version>/weights.safetensors (written, then renamed into place: a server
    never reads a half-written file); older versions but the one before are removed."""
    base = Path(root)
    final, tmp = base / f"v{version}", base / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "weights.safetensors"),
              metadata={KIND_KEY: kind})
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    prune_versions(base, "v", version)
    return str(final)
