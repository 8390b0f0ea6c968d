"""Messages between the learner and rollout actors over torch.distributed (gloo) point-to-
point: a float64 header of ``HEADER`` numbers (the last one is the payload's size in
bytes) followed by one uint8 payload holding several tensors back to back. Two messages
per transfer instead of one per tensor: every gloo send/recv is a round trip."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

HEADER = 8


class ActorFailed(RuntimeError):
    """A rollout actor died or raised; the message says which and why."""


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


def send_message(header: Sequence[float], payload: torch.Tensor, dst: int) -> None:
    import torch.distributed as dist

    h = torch.zeros(HEADER, dtype=torch.float64)
    h[:len(header)] = torch.tensor([float(x) for x in header], dtype=torch.float64)
    h[HEADER - 1] = payload.numel()
    dist.send(h, dst)
    if payload.numel():
        dist.send(payload, dst)


def recv_message(src: int) -> Tuple[List[float], torch.Tensor]:
    """(header numbers, uint8 payload). A peer that dies closes its gloo sockets, so the
    wait ends in ``ActorFailed`` instead of a hang (tests/engine/test_engine_async.py)."""
    import torch.distributed as dist

    h = torch.empty(HEADER, dtype=torch.float64)
    try:
        dist.recv(h, src)
        payload = torch.empty(int(h[HEADER - 1]), dtype=torch.uint8)
        if payload.numel():
            dist.recv(payload, src)
    except RuntimeError as exc:     # the peer's sockets closed: it died
        raise ActorFailed(f"rollout process (rank {src}) exited unexpectedly ({exc})") from exc
    return h.tolist(), payload
