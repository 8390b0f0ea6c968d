"""The ``server`` engine: a client of one or several completions servers (``rlctl serve``;
docs/engines.md says which vLLM/SGLang fields it speaks). Standard library HTTP only.

* generate: the prompts are cut into requests of ``chunk_size`` prompts, request j
  seeded with ``chunk_seed(seed, j)``; one thread per usable server takes the next
  request as soon as it is free (least busy first), so the tokens do not depend on how
  many servers there are or which ran what. A request that fails (no connection,
  timeout, 5xx) names its server in one line and goes to the others; a 4xx is the
  request's fault and is raised (UserError, the server's message).
* weights: ``update_weights`` pushes to every server that is up, with a version; the last
  push is kept and re-sent to a server that comes back. A server is used only while
  its weights are at most ``max_staleness`` versions behind the newest push (checked
  again on every reply's ``weights_version``).
* a lost server is probed (GET /version) at the start of a later ``generate``, at most
  every ``recheck_s`` seconds, and taken back in one line once it answers.
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from rlctl.errors import UserError
from rlctl.rollout.engine import Completion, Sampling, check_sampling, chunk_seed
from rlctl.rollout.weights import to_bytes


class NoServerLeft(UserError):
    """Every server is lost or too stale."""


class _Lost(Exception):
    """A server did not answer or answered 5xx."""


@dataclass
class Server:
    url: str
    up: bool = True
    weights_version: int = 0
    lost_at: float = 0.0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ServerEngine:
    def __init__(self, urls: Sequence[str], max_staleness: int = 0, chunk_size: int = 64,
                 timeout_s: float = 300.0, recheck_s: float = 5.0,
                 say: Callable[[str], None] = _say):
        if not urls:
            raise UserError("the server engine needs at least one server URL")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.max_staleness, self.chunk_size = int(max_staleness), int(chunk_size)
        self.timeout_s, self.recheck_s, self.say = timeout_s, recheck_s, say
        self._push: Optional[tuple] = None            # (version, route, body, content type)
        self._lock = threading.Lock()
        for s in self.servers:
            try:
                s.weights_version = int(self._get(s, "/version", 10.0)["weights_version"])
            except _Lost as exc:
                self._lose(s, exc)
        self.version = max(s.weights_version for s in self.servers)

    # -- weights ------------------------------------------------------------------------
    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor],
                       kind: str = "full") -> None:
        """Push full weights or an adapter (rollout/weights.py) to every server that is up."""
        self._broadcast(int(version), f"/update_weights?version={int(version)}",
                        to_bytes(tensors, kind), "application/octet-stream")

    def update_weights_from_disk(self, version: int, path: str) -> None:
        """Every server loads ``path`` (safetensors, on a directory they all see)."""
        body = json.dumps({"path": str(path), "version": int(version)}).encode()
        self._broadcast(int(version), "/update_weights_from_disk", body, "application/json")

    def _broadcast(self, version: int, route: str, body: bytes, ctype: str) -> None:
        self._push = (version, route, body, ctype)
        self.version = version
        for s in self.servers:
            if s.up:
                self._send_weights(s)

    def _send_weights(self, s: Server) -> bool:
        version, route, body, ctype = self._push
        try:
            s.weights_version = int(self._post(s, route, body, ctype, self.timeout_s)["weights_version"])
            return True
        except _Lost as exc:
            self._lose(s, exc)
            return False

    # -- health -------------------------------------------------------------------------
    def health(self) -> Dict[str, object]:
        self._recheck(force=True)
        usable = [s.url for s in self.servers if self._usable(s)]
        return {"status": "ok" if usable else "down", "weights_version": self.version,
                "servers": {s.url: {"up": s.up, "weights_version": s.weights_version}
                            for s in self.servers}}

    def _usable(self, s: Server) -> bool:
        return s.up and self.version - s.weights_version <= self.max_staleness

    def _lose(self, s: Server, exc: BaseException) -> None:
        with self._lock:
            if not s.up:
                return
            s.up, s.lost_at = False, time.monotonic()
            others = sum(self._usable(o) for o in self.servers)
        self.say(f"rollout server {s.url} lost ({exc}); its requests go to the other {others}")

    def _recheck(self, force: bool = False) -> None:
        """Probe lost servers (due every ``recheck_s``) and send the newest weights to any
        server, lost or not, whose weights are too old to be used."""
        now = time.monotonic()
        for s in self.servers:
            if self._usable(s) or (not s.up and not force and now - s.lost_at < self.recheck_s):
                continue
            was_lost = not s.up
            if was_lost:
                try:
                    s.weights_version = int(self._get(s, "/version", 2.0)["weights_version"])
                except _Lost:
                    s.lost_at = now
                    continue
                s.up = True
            if self._push is not None and not self._usable(s) and not self._send_weights(s):
                continue
            self.say(f"rollout server {s.url} is back (weights version {s.weights_version})"
                     if was_lost else
                     f"rollout server {s.url} sent weights version {s.weights_version}")

    # -- generation ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 seed: Optional[int] = None) -> List[Completion]:
        check_sampling(sampling)
        self._recheck()
        size = max(1, self.chunk_size)
        todo: "queue.Queue" = queue.Queue()
        for j in range(0, len(prompts), size):
            todo.put((j // size, [list(p) for p in prompts[j:j + size]]))
        done: Dict[int, List[Completion]] = {}
        errors: List[BaseException] = []
        while todo.qsize() and not errors:
            workers = [s for s in self.servers if self._usable(s)]
            if not workers:
                raise NoServerLeft(f"no rollout server left with weights within max_staleness="
                                   f"{self.max_staleness} of version {self.version}: "
                                   + ", ".join(s.url for s in self.servers))
            threads = [threading.Thread(target=self._work, args=(s, todo, done, errors, sampling, seed))
                       for s in workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return [c for j in sorted(done) for c in done[j]]

    def _work(self, s: Server, todo, done, errors, sampling: Sampling, seed) -> None:
        while not errors:
            try:
                j, rows = todo.get_nowait()
            except queue.Empty:
                return
            try:
                outs = self._complete(s, rows, sampling, chunk_seed(seed, j))
            except _Lost as exc:
                todo.put((j, rows))
                self._lose(s, exc)
                return
            except UserError as exc:
                errors.append(exc)
                return
            if outs is None:             # answered with weights too old: not used again
                todo.put((j, rows))
                return
            done[j] = outs

    def _complete(self, s: Server, rows, sampling: Sampling, seed) -> Optional[List[Completion]]:
        body = {"prompt": rows, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_k": sampling.top_k,
                "stop_token_ids": list(sampling.stop_ids), "ignore_eos": True, "logprobs": 0,
                "seed": seed}
        reply = self._post(s, "/v1/completions", json.dumps(body).encode(), "application/json",
                           self.timeout_s)
        version = int(reply.get("weights_version", 0))
        s.weights_version = version
        if self.version - version > self.max_staleness:
            self.say(f"rollout server {s.url} answered with weights version {version}, "
                     f"{self.version} pushed (max_staleness={self.max_staleness}): not used "
                     "until it has them")
            return None
        return [Completion(list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]],
                           c["finish_reason"], version) for c in reply["choices"]]

    # -- HTTP ---------------------------------------------------------------------------
    def _get(self, s: Server, route: str, timeout: float) -> dict:
        return self._call(urllib.request.Request(s.url + route), timeout)

    def _post(self, s: Server, route: str, body: bytes, ctype: str, timeout: float) -> dict:
        req = urllib.request.Request(s.url + route, data=body, method="POST",
                                     headers={"Content-Type": ctype})
        return self._call(req, timeout)

    @staticmethod
    def _call(req: urllib.request.Request, timeout: float) -> dict:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                raise _Lost(f"HTTP {exc.code}") from None
            raise UserError(f"{req.full_url}: {_message(exc)}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Lost(f"{type(reason).__name__}: {reason}") from None


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return f"HTTP {exc.code}: {json.loads(exc.read())['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {exc.code}"
