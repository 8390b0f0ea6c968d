"""The ``server`` engine: a client of completions servers of one kind (docs/engines.md)."""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from rlctl.errors import UserError
from rlctl.rollout.engines.protocol import Completion, Engine, Sampling, check_sampling, chunk_seed
from rlctl.rollout.engines.kinds import KINDS, Link, ServerKind, configured_kind, server_kind# noqa: F401


class NoServerLeft(UserError):
    """Every server is lost or too stale."""


class _Lost(Exception):
    """A server did not answer or answered 5xx."""


_UNREADABLE = (KeyError, IndexError, TypeError, ValueError, AttributeError)   # a reply's shape


@dataclass
class Server:
    url: str
    up: bool = True
    weights_version: int = 0
    lost_at: float = 0.0
    restarted: bool = False      # its version went back: not used until sent the newest push


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ServerEngine(Engine):
    def __init__(self, urls: Sequence[str], max_staleness: int = 0, chunk_size: int = 64,
                 timeout_s: float = 300.0, recheck_s: float = 5.0,
                 say: Callable[[str], None] = _say, kind: Union[str, ServerKind] = "rlctl"):
        """``kind``: a name in ``KINDS``, or an adapter built with its options."""
        self.kind = server_kind(kind)
        if not urls:
            raise UserError("the server engine needs at least one server URL")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.max_staleness, self.chunk_size = int(max_staleness), int(chunk_size)
        self.timeout_s, self.recheck_s, self.say = timeout_s, recheck_s, say
        self._push: Optional[tuple] = None            # (version, push to one server)
        self._part: tuple = (None, 0)                  # (version, index of its next part)
        self._lock = threading.Lock()
        for s in self.servers:
            try:
                s.weights_version = self._probe(s, 10.0)
            except _Lost as exc:
                self._lose(s, exc)
        self.version = max(s.weights_version for s in self.servers)

    def update_weights(self, version: int, tensors: Dict[str, torch.Tensor],
                       kind: str = "full", last: bool = True) -> None:
        """Push full weights or an adapter, or a part of them (``last``: the final part), to
        every server that is up."""
        v = int(version)
        part = self._part[1] if self._part[0] == v else 0        # this part's index in version v
        self._part = (None, 0) if last else (v, part + 1)
        push = self.kind.push(v, tensors, kind, part, last)
        if push is not None:     # a kind that sends parts: only a one-part push can be sent again
            self._broadcast(v, push, last, last and (part == 0 or not self.kind.sends_parts))

    def update_weights_from_disk(self, version: int, path: str) -> None:
        """Every server loads ``path`` (safetensors, on a directory they all see)."""
        self._broadcast(int(version), self.kind.push_from_disk(int(version), path))

    def _broadcast(self, version: int, push, last: bool = True, whole: bool = True) -> None:
        """``last``: the servers switch to ``version``; ``whole``: ``push`` alone brings a server
        there (kept for servers that come back)."""
        self._push = (version, push) if whole else None
        self.version = version if last else self.version
        up = [s for s in self.servers if s.up]
        if not self.kind.parallel_push:        # a kind that keeps per-push state in the client
            for s in up:
                self._send_weights(s, version, push)
            return
        errors: List[BaseException] = []

        def send(s: Server) -> None:
            try:
                self._send_weights(s, version, push)
            except Exception as exc:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(exc)
        _all_at_once(send, up)        # a push costs one transfer, not n
        if errors:
            raise errors[0]

    def _send_weights(self, s: Server, version: int, push) -> bool:
        try:
            reported = self._read(s, "weights", push, self._link(s, self.timeout_s))
            s.weights_version = version if reported is None else int(reported)
            s.restarted = False
            return True
        except _Lost as exc:
            self._lose(s, exc)
            return False

    def health(self) -> Dict[str, object]:
        self._recheck(force=True)
        usable = [s.url for s in self.servers if self._usable(s)]
        return {"status": "ok" if usable else "down", "weights_version": self.version,
                "servers": {s.url: {"up": s.up, "weights_version": s.weights_version}
                            for s in self.servers}}

    def metrics(self) -> Dict[str, float]:
        return {"engine/servers_up": float(sum(s.up for s in self.servers))}

    def quiet(self) -> None:
        self.say = lambda message: None

    def _usable(self, s: Server) -> bool:
        return s.up and not s.restarted and self.version - s.weights_version <= self.max_staleness

    def _lose(self, s: Server, exc: BaseException) -> None:
        with self._lock:
            if not s.up:
                return
            s.up, s.lost_at = False, time.monotonic()
            others = sum(o.up for o in self.servers)          # s is down already
        self.say(f"rollout server {s.url} lost ({exc}); its requests go to the other {others}")

    def _recheck(self, force: bool = False) -> None:
        """Probe lost servers (every ``recheck_s``); push the newest weights to those back or stale."""
        now = time.monotonic()
        for s in self.servers:
            if self._usable(s) or (not s.up and not force and now - s.lost_at < self.recheck_s):
                continue
            was_lost = not s.up
            if not was_lost and self._push is None:     # nothing to send: the next push
                continue
            if was_lost:
                try:
                    s.weights_version = self._probe(s, 2.0)
                except _Lost:
                    s.lost_at = now
                    continue
                s.up = True
            # back: the newest push even when within max_staleness (it missed that push)
            if self._push is not None and (was_lost or not self._usable(s)) and not self._send_weights(s, *self._push):
                continue
            self.say(f"rollout server {s.url} is back (weights version {s.weights_version})"
                     if was_lost else
                     f"rollout server {s.url} sent weights version {s.weights_version}")

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
        retried = False
        while todo.qsize() and not errors:
            workers = [s for s in self.servers if self._usable(s)]
            if not workers and not retried:      # e.g. the only server, restarted: push, ask again
                retried = True
                self._recheck()
                workers = [s for s in self.servers if self._usable(s)]
            if not workers:
                raise NoServerLeft(f"no rollout server left with weights within max_staleness="
                                   f"{self.max_staleness} of version {self.version}: "
                                   + ", ".join(s.url for s in self.servers))
            _all_at_once(lambda s: self._work(s, todo, done, errors, sampling, seed), workers)
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
            except Exception as exc:  # noqa: BLE001 - raised in the caller's thread
                errors.append(exc)
                return
            if outs is None:             # answered with weights too old: not used again
                todo.put((j, rows))
                return
            done[j] = outs

    def _complete(self, s: Server, rows, sampling: Sampling, seed) -> Optional[List[Completion]]:
        outs, reported = self._read(s, "completions", self.kind.complete,
                                    self._link(s, self.timeout_s), rows, sampling, seed)
        if len(outs) != len(rows) or any(c is None for c in outs):
            raise UserError(f"rollout server {s.url} answered {sum(c is not None for c in outs)} "
                            f"completions for a request of {len(rows)} prompts")
        version = s.weights_version if reported is None else int(reported)
        if version < s.weights_version and self._push is not None:
            self.say(f"rollout server {s.url} answered with weights version {version} after "
                     f"{s.weights_version}: restarted, sent the newest weights before it serves again")
            s.weights_version, s.restarted = version, True    # its own load, not a learner version
            return None
        s.weights_version = version
        if self.version - version > self.max_staleness:
            self.say(f"rollout server {s.url} answered with weights version {version}, "
                     f"{self.version} pushed (max_staleness={self.max_staleness}): not used "
                     "until it has them")
            return None
        for c in outs:
            c.weights_version = version
        return outs

    def _probe(self, s: Server, timeout: float) -> int:
        """The kind's probe; a version not reported is 0 (the weights it started with)."""
        reported = self._read(s, "probe", self.kind.probe, self._link(s, timeout))
        return 0 if reported is None else int(reported)

    def _read(self, s: Server, what: str, call, *args):
        """``call(*args)``; a reply the kind cannot read is one line naming server and kind."""
        try:
            return call(*args)
        except (_Lost, UserError):
            raise
        except _UNREADABLE as exc:
            raise UserError(f"rollout server {s.url} sent a {what} reply the {self.kind.name} kind "
                            f"cannot read ({type(exc).__name__}: {exc}); is rollout.server.kind right? "
                            f"valid: {', '.join(KINDS)}") from None

    def _link(self, s: Server, timeout: float) -> Link:
        def call(route: str, body: Optional[bytes], ctype: str, expect_json: bool) -> dict:
            headers = {} if body is None else {"Content-Type": ctype}      # a body: POST
            req = urllib.request.Request(s.url + route, data=body, headers=headers)
            return _http(req, timeout, expect_json)
        return Link(s.url, call)


def _http(req: urllib.request.Request, timeout: float, expect_json: bool) -> dict:
    """The reply's JSON; a 5xx or no answer is a lost server, a 4xx one line (UserError)."""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = resp.read()
        if not expect_json:
            try:
                reply = json.loads(data) if data else {}
            except ValueError:
                return {}
            return reply if isinstance(reply, dict) else {"reply": reply}
        return json.loads(data)
    except urllib.error.HTTPError as exc:
        if exc.code >= 500:
            raise _Lost(f"HTTP {exc.code}") from None
        raise UserError(f"{req.full_url}: {_message(exc)}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Lost(f"{type(reason).__name__}: {reason}") from None


def _all_at_once(fn: Callable, items) -> None:
    """``fn(item)`` for every item, each in a thread of its own, all joined."""
    threads = [threading.Thread(target=fn, args=(x,)) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _message(exc: urllib.error.HTTPError) -> str:
    """The error body's message (OpenAI's, vLLM's older, FastAPI's), else the status alone."""
    try:
        body = json.loads(exc.read())
        err = body.get("error")
        text = err.get("message") if isinstance(err, dict) else err or body.get("message") or body.get("detail")
        return f"HTTP {exc.code}: {text}" if text else f"HTTP {exc.code}"
    except (ValueError, AttributeError, TypeError):
        return f"HTTP {exc.code}"
