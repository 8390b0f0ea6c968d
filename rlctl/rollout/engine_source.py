"""Rollouts from a generation engine (``rollout.engine=server``): the learner's prompts
sent as token ids to an engine (rlctl/rollout/engine.py), the completions scored here and
laid out as the learner's ``RolloutBatch``; the learner's weights pushed to the engine.

* **Seeds.** Each request draws its prompts and one seed from ``sampler`` (the checkpointed
  prompt RNG), so a run's tokens depend on that seed and the engine's ``chunk_size`` only:
  one server, two servers, or the ``torch`` engine in this process with the same
  ``chunk_size`` give the same tokens (tests/rollout/test_engine_source.py).
* **Weights.** The learner's weights go with the first request (the engine then holds
  them, whatever it loaded; a resumed run's are the checkpoint's, loaded after this
  source was built), then a new version after updates: when the
  engine's copy is ``sync_every`` updates old, or sooner when the staleness bound needs
  it. A LoRA policy pushes its adapter only (``policy_weights``). ``weight_dir``: the
  weights go through that directory (``update_weights_from_disk``; servers that see it)
  instead of the HTTP body.
* **Ahead.** With ``max_staleness`` >= 1 the next request is made while the learner
  updates (one request ahead, in a worker thread); the rows it returns are at most one
  update old when consumed, and carry the engine's log-probs as ``old_logprobs`` (the
  PPO ratio's behaviour policy). With 0 every request follows the update and uses the
  newest weights: the synchronous loop, the learner computing pi_old itself.
* Versions count learner updates from one past the engine's version when the source
  started (servers that outlive a run keep their count; the first push is never a
  version a server may hold without it).
"""
from __future__ import annotations

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
    """B prompts drawn from ``examples`` by ``sampler``, G completions each from
    ``engine``, scored by ``scorer``; ``policy``: the module the learner trains (its
    weights are pushed). ``on_close``: called last by ``close`` (e.g. stop the servers
    the run started)."""

    def __init__(self, engine, policy, tokenizer, examples: Sequence[Example], scorer,
                 sampling: SamplingSettings, settings: EngineSettings, seed: int,
                 device=None, on_close: Optional[Callable[[], None]] = None):
        self.engine, self.policy, self.tokenizer = engine, policy, tokenizer
        self.examples, self.scorer, self.settings = list(examples), scorer, settings
        self.sampling = sampling
        self.sampler = random.Random(seed)
        self.device = device if device is not None else next(policy.parameters()).device
        self.stops = resolve_stop_ids(policy, tokenizer, sampling.stop_token_ids)
        self.pad_id = int(tokenizer.pad_token_id)
        self.on_close = on_close
        # the learner's weights: one past the engine's count when we started, never equal
        # to what a server holds unpushed (a server restarted unseen reports 0, its own
        # load: with the first push at 0 its rows would pass as the learner's)
        self.version = int(getattr(engine, "version", 0)) + 1
        # the engine's weights version; None: nothing pushed yet. The first request pushes
        # (not this constructor): a resumed run loads its checkpoint's weights after this.
        self.pushed: Optional[int] = None
        self.ahead: Optional[Future] = None        # the request made while the learner updates
        self.stats: Dict[str, List[float]] = {}

    # -- weights -----------------------------------------------------------------------
    def _snapshot(self):
        tensors, kind = policy_weights(self.policy)
        return self.version, tensors, kind

    def _push(self, snap) -> float:
        """Send ``snap`` (version, tensors, kind) to the engine; returns the seconds it took."""
        version, tensors, kind = snap
        t0 = time.perf_counter()
        if self.settings.weight_dir is None:
            self.engine.update_weights(version, tensors, kind)
        else:
            self.engine.update_weights_from_disk(version, _write(self.settings.weight_dir, version,
                                                                 tensors, kind))
        return time.perf_counter() - t0

    def _needs_push(self, consumed_at: int) -> bool:
        s = self.settings
        return (self.pushed is None or self.version - self.pushed >= s.sync_every
                or self.pushed < consumed_at - s.max_staleness)

    # -- requests ----------------------------------------------------------------------
    def _request(self, num_groups: int, consumed_at: int):
        """Draw the next request's rows and seed (in this thread, in order) and take a
        weights snapshot if the engine must have newer ones; returns the job to run."""
        examples = [self.examples[i] for i in self.draw(num_groups)]
        seed = self.sampler.getrandbits(62)
        snap = self._snapshot() if self._needs_push(consumed_at) else None
        if snap is not None:
            self.pushed = snap[0]          # booked now: the next request does not push it again
        G, s = self.sampling.group_size, self.sampling
        ids = [self.tokenizer(ex.prompt)["input_ids"] for ex in examples]
        rows = [p for p in ids for _ in range(G)]                        # N = B * G, grouped
        sampling = Sampling(s.max_new_tokens, s.temperature, s.top_k, tuple(self.stops))

        def job():          # may run in the worker thread: it only calls the engine
            push_s = self._push(snap) if snap is not None else 0.0
            t0 = time.perf_counter()
            outs = self.engine.generate(rows, sampling, seed)
            return examples, rows, outs, time.perf_counter() - t0, push_s
        return job

    def sample(self, num_groups: int) -> RolloutBatch:
        t0 = time.perf_counter()
        if self.ahead is not None:
            examples, rows, outs, gen_s, push_s = self.ahead.result()
            self.ahead = None
        else:
            examples, rows, outs, gen_s, push_s = self._request(num_groups, self.version)()
        self._log("time/learner_wait_s", time.perf_counter() - t0)
        self._log("time/engine_generate_s", gen_s)
        self._log("time/weight_sync_s", push_s)
        if self.settings.max_staleness > 0:          # made while the learner updates
            self.ahead = _in_thread(self._request(num_groups, self.version + 1))
        return self._batch(examples, rows, outs)

    def after_update(self) -> None:
        self.version += 1

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
        """Waits ``CLOSE_WAIT_S`` at most for a request still ahead (a hung server must not
        hold the run's exit for its ``timeout_s``), then leaves it to its daemon thread."""
        try:
            if self.ahead is not None:
                try:
                    self.ahead.result(CLOSE_WAIT_S)
                except FutureTimeout:
                    _quiet(self.engine)
                except Exception:  # noqa: BLE001 - nobody reads this request: the run is over
                    pass
                self.ahead = None
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
