"""Local engines: the torch engine in a child process, reached through a pipe.

``LocalEngine`` is the engine protocol (rollout/engine.py) on the learner's side of a
``multiprocessing`` pipe; ``serve_engine`` is the child's loop. A message is one pickled
tuple (tensors inside, as their bytes; no HTTP, no JSON): ("generate", prompts, Sampling,
seed), ("weights", version, safetensors bytes) in the format of rollout/weights.py
(``to_bytes``: the body a server is pushed; not answered, a failure to load is the answer
to the next request), ("play",
rows, env_seed, rng state or None) for an episodic task (the child holds the task and plays
the learner's rows as episodes, rollout/episodes.py), ("health",), ("stop",). The reply is
("ok", value, torch RNG state after a call seeded with a state, else None), or ("error",
the UserError raised) or ("failed", one line). A child that exits, or does not answer
within ``timeout_s``, is one line (``ActorFailed``) naming it.
"""
from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Dict, List, Optional, Sequence

import torch

from rlctl.errors import ActorFailed, UserError
from rlctl.rollout.engine import Completion, Sampling, TorchEngine
from rlctl.rollout.weights import from_bytes, to_bytes
from rlctl.types import RolloutBatch

TIMEOUT_S = 300.0


class LocalEngine:
    """The engine protocol over ``conn`` to the child process ``proc`` (``name``: how
    errors call it). ``rng_state``: the torch RNG state the child's last call seeded with
    a state ended with."""

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
        self.rng_state = reply[2]
        return reply[1]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seed=None) -> List[Completion]:
        return self._call("generate", [list(p) for p in prompts], sampling, seed)

    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor], kind: str = "full") -> None:
        try:
            self._send(("weights", int(version), to_bytes(tensors, kind)))
        except OSError:
            self._call("health")          # names the lost process
        self.version = int(version)

    def play(self, rows: List[int], env_seed: int, rng: Optional[torch.Tensor]) -> RolloutBatch:
        """The learner's ``rows`` (indices of the task's training split) played as episodes
        with the environments' seed ``env_seed``, sampling from ``rng`` (None: the child's
        own stream); the batch's ``weights_version`` rides in ``staleness`` (every row)."""
        return self._call("play", rows, env_seed, rng)

    def health(self) -> Dict[str, object]:
        return self._call("health")

    def stop(self, learner_failed: bool) -> None:
        """Ask the child to end (it exits after this message); no answer is read."""
        try:
            self.conn.send_bytes(pickle.dumps(("stop", learner_failed)))
        except OSError:
            pass


def serve_engine(engine: TorchEngine, conn, player=None, examples=()) -> str:
    """The child's loop: answer the learner until it says stop or the pipe closes.
    ``player``/``examples``: the episodic task's player and training rows (else None).
    Returns what ended it ("" after a normal stop)."""
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
                    engine.update_weights(args[0], *from_bytes(args[1]))
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
        return moved(batch.replace(staleness=version), "cpu"), torch.get_rng_state() if rng is not None else None
    if op == "health":
        return engine.health(), None
    raise ValueError(f"unknown request '{op}'")


def moved(batch: RolloutBatch, device) -> RolloutBatch:
    """``batch`` with every tensor field on ``device``."""
    return batch.replace(**{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                            if isinstance(getattr(batch, f.name), torch.Tensor)})
