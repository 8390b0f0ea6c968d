"""Messages between the learner and rollout actors over torch.distributed (gloo) point-to-
point: a float64 header of ``HEADER`` numbers (the last one is the payload's size in
bytes) followed by one uint8 payload holding several tensors back to back. Two messages
per transfer instead of one per tensor: every gloo send/recv is a round trip."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import re

import torch
import torch.distributed as dist

from rlctl.errors import ActorFailed

HEADER = 8


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors -> one flat uint8 buffer (their bytes, in order)."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buf: torch.Tensor, specs: Sequence[Tuple[Sequence[int], torch.dtype]]) -> List[torch.Tensor]:
    """Inverse of ``pack`` given each tensor's (shape, dtype); copies, so every result is
    aligned and owns its memory."""
    out, at = [], 0
    for shape, dtype in specs:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        out.append(buf[at:at + n].clone().view(dtype).reshape(tuple(shape)))
        at += n
    if at != buf.numel():
        raise ValueError(f"message size mismatch: {buf.numel()} bytes, {at} expected")
    return out


def _header(header: Sequence[float], payload: torch.Tensor) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.float64)
    h[:len(header)] = torch.tensor([float(x) for x in header], dtype=torch.float64)
    h[HEADER - 1] = payload.numel()
    return h


def send_message(header: Sequence[float], payload: torch.Tensor, dst: int) -> None:

    dist.send(_header(header, payload), dst)
    if payload.numel():
        dist.send(payload, dst)


class Sent:
    """A message handed to gloo's background transfer (``isend``); holds its buffers."""

    def __init__(self, header: Sequence[float], payload: torch.Tensor, dst: int):

        self.buffers = (_header(header, payload), payload)
        self.works = [dist.isend(self.buffers[0], dst)]
        if payload.numel():
            self.works.append(dist.isend(payload, dst))

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class Posted:
    """A header receive posted ahead (``irecv``): the header lands while the learner
    works; ``finish`` waits for it and receives the payload."""

    def __init__(self, src: int):

        self.src, self.header = src, torch.empty(HEADER, dtype=torch.float64)
        self.work = dist.irecv(self.header, src)

    def finish(self) -> Tuple[List[float], torch.Tensor]:

        try:
            self.work.wait()
            payload = torch.empty(int(self.header[HEADER - 1]), dtype=torch.uint8)
            if payload.numel():
                dist.recv(payload, self.src)
        except RuntimeError as exc:     # the peer's sockets closed (it died), or it went silent
            raise ActorFailed(gloo_reason(exc)) from exc
        return self.header.tolist(), payload


def gloo_reason(exc: BaseException, timeout: str = "the group's timeout") -> str:
    """Why a transfer with a peer failed, in a few words: gloo's "Timed out waiting ...ms"
    (the peer or its host went silent) is "did not answer within ``timeout``"; otherwise
    gloo's first sentence without its source location or its closing advice, e.g.
    "exited unexpectedly (Connection closed by peer [127.0.0.1]:18657)"."""
    text = " ".join(str(exc).split())
    if "Timed out" in text:
        return f"did not answer within {timeout}"
    text = re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0]     # "[.../pair.cc:553] Connection ..."
    return f"exited unexpectedly ({text[:160]})"


def recv_message(src: int) -> Tuple[List[float], torch.Tensor]:
    """(header numbers, uint8 payload). A peer that dies closes its gloo sockets, so the
    wait ends in ``ActorFailed`` instead of a hang (tests/engine/test_engine_async.py)."""
    return Posted(src).finish()
