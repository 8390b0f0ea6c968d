"""Rollouts from engines (servers, or local engine processes), laid out and scored as the
learner's batch, and the staleness controller (docs/engines.md). ``LocalEngine``/``serve_engine``:
a pipe of pickled tuples ("generate" | "weights" | "play" | "health" | "stop", args...) answered
("ok", value, rng state or None), ("error", UserError) or ("failed", line); a child that exits
or is silent for ``timeout_s``: ``ActorFailed``."""
from __future__ import annotations

import collections
import itertools
import pickle
import random
import shutil
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.nn.utils.rnn import pad_sequence

from rlctl.config.schema import AsyncConfig, RolloutConfig
from rlctl.core.logprobs import completion_mask
from rlctl.errors import ActorFailed, UserError
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.models.value import PolicyValueModel
from rlctl.rollout.engines.protocol import (Completion, Engine, Sampling, TorchEngine, from_bytes,
                                  claim_version, prune_versions, to_bytes)
from rlctl.rollout.generate import left_padded, scored
from rlctl.rollout.source import SEED_RANGE, SyncSource
from rlctl.types import Example, LogProbs, RolloutBatch

TIMEOUT_S = 300.0


def staleness_bounds(ahead: AsyncConfig) -> Tuple[int, int]:
    """(max_staleness, sync_every): ``trainer.async_rollout``'s, (0, 1) when it is off."""
    return (int(ahead.max_staleness), int(ahead.sync_every)) if ahead.enabled else (0, 1)


Gather = Callable[..., Iterator[Dict[str, torch.Tensor]]]     # (module, names=) -> CPU buckets


def policy_weights(policy, gather: Gather) -> Iterator[Tuple[Dict[str, torch.Tensor], str]]:
    """(tensors, kind) parts to serve ``policy``: a LoRA adapter (A; B scaled) or every parameter,
    as CPU tensors, a bucket of ``gather`` (the backend's ``weight_buckets``) at a time."""
    model = policy.policy if isinstance(policy, PolicyValueModel) else policy
    if not hasattr(model, "peft_config"):
        yield from ((part, "full") for part in gather(model, names=None))
        return
    base, served = model.get_base_model(), {}          # parameter -> (served name, scale)
    for name, m in base.named_modules():
        if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
            served[f"{name}.lora_A.default.weight"] = (f"{name}.lora_A", None)
            served[f"{name}.lora_B.default.weight"] = (f"{name}.lora_B", m.scaling["default"])
    for part in gather(base, names=list(served)):
        yield {served[k][0]: t if served[k][1] is None else t * served[k][1]
               for k, t in part.items()}, "adapter"


class EngineSource(SyncSource):
    """B prompts from ``examples``, G completions each from the engine(s), scored by ``scorer``."""

    def __init__(self, engine, policy, tokenizer, examples: Sequence[Example], scorer,
                 rollout: RolloutConfig, group_size: int, ahead: AsyncConfig, seed: int,
                 gather: Gather, device=None, on_close: Optional[Callable[[], None]] = None,
                 learner_rng: bool = False, player=None):
        """``gather``: the learner's weights in buckets (``policy_weights``)."""
        self.engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
        self.engine, self.policy, self.tokenizer = self.engines[0], policy, tokenizer
        self.examples, self.scorer, self.rollout = list(examples), scorer, rollout
        self.group_size, self.learner_rng, self.player = group_size, learner_rng, player
        self.gather = gather
        self.max_staleness, self.sync_every = staleness_bounds(ahead)
        server = rollout.server
        self.weight_dir = server.weight_dir if server.weight_sync == "disk" else None
        self.prompt_rng = random.Random(seed)
        self.device = device if device is not None else next(policy.parameters()).device
        self.stops = resolve_stop_ids(policy, tokenizer, tuple(rollout.stop_token_ids or ()))
        self.pad_id = int(tokenizer.pad_token_id)
        self.on_close = on_close
        # one past the engines' count: never a version a server may hold unpushed
        self.version = max(e.version for e in self.engines) + 1
        # each engine's version; None: the first request pushes (a resume loads weights after)
        self.pushed: List[Optional[int]] = [None] * len(self.engines)
        self.idle = collections.deque(range(len(self.engines)))
        self.pending: collections.deque = collections.deque()   # (engine index, Future)
        self.took = False                                  # this step consumed a rollout
        self.stats: Dict[str, List[float]] = {}

    def _push(self, engine, version: int) -> float:
        """The policy's weights to ``engine`` as ``version``, one bucket at a time -> seconds."""
        t0 = time.perf_counter()
        parts = policy_weights(self.policy, self.gather)
        if self.weight_dir is None:
            part = next(parts, None)
            if part is None:
                raise UserError("no weights to push to the engines: the policy has no parameters "
                                "to serve (a LoRA model needs its 'default' adapter)")
            for following in itertools.chain(parts, [None]):     # the last one says so
                engine.update_weights(version, *part, last=following is None)
                part = following
        else:
            engine.update_weights_from_disk(version, _write(self.weight_dir, version, parts))
        return time.perf_counter() - t0

    def _fill(self, num_groups: int) -> None:
        """Request ahead while an engine is idle and the next would be at most ``max_staleness``
        old when consumed (k pending: at version + k, +1 once one was taken)."""
        while self.idle:
            latest = self.version + len(self.pending) + int(self.took)
            if latest - self.version > self.max_staleness:
                break
            self._request(self.idle.popleft(), num_groups, latest)

    def _request(self, e: int, num_groups: int, consumed_at: int) -> None:
        """Draw the rows and seed, snapshot the weights if engine ``e`` needs them, start the request."""
        engine, rows = self.engines[e], self.draw(num_groups)
        env_seed = self.prompt_rng.randrange(SEED_RANGE) if self.player is not None else None
        if self.learner_rng:
            seed = torch.get_rng_state() if self.max_staleness == 0 else None
        else:
            seed = self.prompt_rng.getrandbits(62)
        push_s, pushed = 0.0, self.pushed[e]
        if (pushed is None or self.version - pushed >= self.sync_every
                or pushed < consumed_at - self.max_staleness):
            # here, on an idle engine: the learner changes its weights after this returns
            push_s, self.pushed[e] = self._push(engine, self.version), self.version
        examples = [self.examples[i] for i in rows]
        G, ro = self.group_size, self.rollout
        prompts = [] if self.player is not None else \
            [p for ex in examples for p in [self.tokenizer(ex.prompt)["input_ids"]] * G]
        sampling = Sampling(ro.max_new_tokens, ro.temperature, ro.top_k, tuple(self.stops))

        def job():          # runs in the worker thread: it only calls the engine
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
        """An engine's episodes; ``logprobs.staleness`` arrives as the weights version."""
        batch = batch.to(self.device)
        lp = batch.logprobs
        stale = self.version - lp.staleness                                            # [N]
        self._log("async/staleness", float(stale.max()))
        return batch.replace(logprobs=dict(staleness=stale, engine=lp.old * batch.mask))

    def _batch(self, examples: List[Example], rows, outs: List[Completion]) -> RolloutBatch:
        """The completions laid out as ``rollout.generate.rollout`` lays out its own."""
        G, dev = self.group_size, self.device
        prompt_ids, prompt_mask = left_padded(rows, self.pad_id, dev)                # [N, P]
        comp = pad_sequence([torch.tensor(c.token_ids, dtype=torch.long) for c in outs], True,
                            self.pad_id).to(dev)                                      # [N, T]
        logp = pad_sequence([torch.tensor(c.logprobs, dtype=torch.float64).float() for c in outs],
                            True).to(dev)                                             # [N, T]
        mask, truncated = completion_mask(comp, self.stops, self.pad_id)
        stale = torch.tensor([self.version - c.weights_version for c in outs], device=dev)  # [N]
        engine_lp = logp * mask                                                       # [N, T]
        batch = scored(self.tokenizer, examples, G, torch.cat([prompt_ids, comp], 1), prompt_mask,
                       mask, truncated, self.stops, self.scorer.score_batch,
                       LogProbs(old=engine_lp if bool((stale > 0).any()) else None,
                                engine=engine_lp, staleness=stale))
        self._log("async/staleness", float(stale.max()))
        return batch.replace(reward_parts=self.scorer.last_components)

    def _log(self, key: str, value: float) -> None:
        self.stats.setdefault(key, []).append(value)

    def metrics(self) -> Dict[str, float]:
        """Staleness (max), times (sums) since the last call, ``engine/servers_up`` (servers)."""
        out = {k: (max(v) if k == "async/staleness" else sum(v)) for k, v in self.stats.items()}
        out.update(self.engine.metrics())
        self.stats = {}
        return out

    def close(self) -> None:
        """Waits ``CLOSE_WAIT_S`` at most for each pending request, then leaves it to its thread."""
        try:
            for e, future in self.pending:
                try:
                    future.result(CLOSE_WAIT_S)
                except FutureTimeout:
                    self.engines[e].quiet()
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
    """``job()`` in a daemon thread (an executor's is joined at exit: a hung request holds it)."""
    future: Future = Future()

    def run():
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - raised where the result is read
                future.set_exception(exc)
    threading.Thread(target=run, name="rlctl-engine", daemon=True).start()
    return future


def _write(root: str, version: int, parts) -> str:
    """``root``/v<version>/part-<i>.safetensors, one file a part of ``parts`` ((tensors, kind)),
    renamed into place; rlctl's older ones pruned."""
    base = Path(root)
    final, tmp = claim_version(base, f"v{version}"), base / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i, (tensors, kind) in enumerate(parts):
        (tmp / f"part-{i:05d}.safetensors").write_bytes(to_bytes(tensors, kind))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    prune_versions(base, "v", version)
    return str(final)


class LocalEngine(Engine):
    """The engine protocol over ``conn`` to the child process ``proc`` (``name`` in errors);
    ``rng_state``: where the last generate or play seeded with an RNG state ended."""

    def __init__(self, proc, conn, name: str, timeout_s: float = TIMEOUT_S):
        self.proc, self.conn, self.name, self.timeout_s = proc, conn, name, timeout_s
        self.version = 0
        self.rng_state: Optional[torch.Tensor] = None

    def _send(self, message) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _call(self, *message):
        try:
            self._send(message)
            deadline = time.monotonic() + self.timeout_s
            while not self.conn.poll(0.5):
                if not self.proc.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    raise ActorFailed(f"lost contact with {self.name}: it did not answer within "
                                      f"{self.timeout_s:g} s")
            reply = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise ActorFailed(f"lost contact with {self.name}: it exited unexpectedly "
                              f"(exit code {self.proc.exitcode})") from None
        if reply[0] == "error":
            raise reply[1]
        if reply[0] == "failed":
            raise ActorFailed(f"{self.name}: {reply[1]}")
        return reply[1], reply[2]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seed=None) -> List[Completion]:
        outs, self.rng_state = self._call("generate", [list(p) for p in prompts], sampling, seed)
        return outs

    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor], kind: str = "full",
                       last: bool = True) -> None:
        try:
            self._send(("weights", int(version), to_bytes(tensors, kind), last))
        except OSError:
            self._call("health")          # names the lost process
        self.version = int(version)

    def play(self, rows: List[int], env_seed: int, rng: Optional[torch.Tensor]) -> RolloutBatch:
        """Training rows played as episodes; the weights version rides in ``logprobs.staleness``."""
        batch, self.rng_state = self._call("play", rows, env_seed, rng)
        return batch

    def health(self) -> Dict[str, object]:
        return self._call("health")[0]

    def stop(self, learner_failed: bool) -> None:
        """Ask the child to end (it exits after this message); no answer is read."""
        try:
            self.conn.send_bytes(pickle.dumps(("stop", learner_failed)))
        except OSError:
            pass


def serve_engine(engine: TorchEngine, conn, player=None, examples=()) -> str:
    """The child's loop until the learner says stop or the pipe closes -> what ended it."""
    failed = None          # a weights push that failed: the answer to the next request
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return "the learner exited"
        op, args = message[0], message[1:]
        if op == "stop":
            return "the learner ended its run early (it says why)" if args[0] else ""
        try:
            if op == "weights":
                try:
                    engine.update_weights(args[0], *from_bytes(args[1]), last=args[2])
                except Exception as exc:  # noqa: BLE001 - answered with the next request
                    failed = exc
                continue
            if failed is not None:
                failed, exc = None, failed
                raise exc
            value, rng = _answer(engine, player, examples, op, args)
            reply = ("ok", value, rng)
        except UserError as exc:
            reply = ("error", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the learner, which stops
            reply = ("failed", f"{type(exc).__name__}: {exc}")
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def _answer(engine: TorchEngine, player, examples, op: str, args):
    if op == "generate":
        outs = engine.generate(*args)
        return outs, engine.rng_state if isinstance(args[2], torch.Tensor) else None
    if op == "play":
        rows, env_seed, rng = args
        if rng is not None:
            torch.set_rng_state(rng)
        batch = player.play(engine.model, [examples[i] for i in rows], env_seed)
        version = torch.full((batch.num_sequences,), engine.version, dtype=torch.long)
        return batch.replace(logprobs=dict(staleness=version)).to("cpu"), \
            torch.get_rng_state() if rng is not None else None
    if op == "health":
        return engine.health(), None
    raise ValueError(f"unknown request '{op}'")
