"""Process groups described by the environment: torchrun, the deepspeed launcher, srun,
or rlctl's own launcher on several nodes.

``from_environment`` reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` /
``MASTER_PORT`` (torchrun and the deepspeed launcher set them), or SLURM's
``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` with the first host of
``SLURM_JOB_NODELIST`` as the master (``MASTER_PORT``, else ``hardware.master_port``).
``join`` exports that description, joins the group through torch's ``env://`` rendezvous
within ``hardware.dist_timeout_s`` and compares every rank's config with rank 0's in one
``all_gather_object``: a rank that cannot reach the master, a master whose peers never
come, a rank started twice, or ranks whose configs differ get one line on every node
instead of a hang. ``share`` passes a short text (the run directory, or rank 0's set-up
error) from rank 0 to every rank through the store. The group's keys live under a prefix
fresh for each restart of torchrun's workers: its agent's store outlives them, and a
restarted attempt must neither dial the failed attempt's ranks nor take its run directory.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from rlctl.backends import launch, same_config
from rlctl.errors import UserError

_STORES: List[object] = []     # the stores this process joined through (kept alive)
_KEY = "rlctl/run_dir"
_FAILED = "!"                  # prefix of a shared value that is rank 0's error line


@dataclass(frozen=True)
class Group:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str                # "torchrun/deepspeed" | "SLURM" | "rlctl" (launch_node, via torchrun's agent)
    node: Optional[int] = None  # this rank's node, where the launcher says (``_node``)

    def env(self) -> Dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def expand_nodelist(nodelist: str) -> List[str]:
    """SLURM's compact host list -> host names: ``node[01-03,07],login`` -> node01,
    node02, node03, node07, login (zero padding kept)."""
    hosts: List[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]*)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain.strip())
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise UserError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read the range '{part}' "
                                "(expected forms like node[01-04,07] or a,b)")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    if not hosts:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def _int(env: Dict[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"{key}={env[key]!r} in the environment is not an integer "
                        "(the launcher sets it to this process's rank or count)") from None


def from_environment(default_port: int, env: Optional[Dict[str, str]] = None) -> Optional[Group]:
    """The process group the environment describes, or None (no launcher: rlctl decides)."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise UserError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: a launcher "
                            "(torchrun, deepspeed) sets all of RANK, WORLD_SIZE, LOCAL_RANK, "
                            "MASTER_ADDR, MASTER_PORT")
        source = "rlctl" if "RLCTL_LAUNCHER_PID" in env else "torchrun/deepspeed"
        return _checked(Group(_int(env, "RANK"), _int(env, "WORLD_SIZE"),
                              _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                              env["MASTER_ADDR"], _int(env, "MASTER_PORT"), source, _node(env)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or expand_nodelist(env.get("SLURM_JOB_NODELIST", "") or
                                                         env.get("SLURM_NODELIST", ""))[0]
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else default_port
        return _checked(Group(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                              _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                              addr, port, "SLURM", _node(env)))
    return None


def _checked(group: Group) -> Group:
    if group.world_size < 1 or not 0 <= group.rank < group.world_size:
        raise UserError(f"the launcher's rank {group.rank} is not in [0, {group.world_size}) "
                        f"(world size {group.world_size}, from {group.source})")
    return group


def join(group: Group, device: str, timeout_s: float,
         run_config: Optional[Dict[str, Any]] = None, stop=None) -> None:
    """Export ``group`` to this process's environment and join it (gloo, nccl on CUDA)
    through torch's ``env://`` rendezvous within ``timeout_s``: a rank that cannot reach the
    master, a master whose peers never come, or a rank started twice (a counter in the
    store) is one line. Then one ``all_gather_object`` of every rank's ``run_config`` (the
    resolved config as plain nested dicts, less per-node keys: same_config) and its
    digest: every rank raises the same line naming the keys that differ from rank 0's.
    ``stop``: a StopFlag whose signal ends the wait for the master (exit 128 + signal)."""

    os.environ.update(group.env())
    if dist.is_initialized():
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(group.local_rank)
    who = f"rank {group.rank} of {group.world_size} ({group.source})"
    where = f"{group.master_addr}:{group.master_port}"
    if group.rank:
        launch.wait_reachable(group.master_addr, group.master_port, time.monotonic() + timeout_s, stop,
                              f"{who}: it cannot reach the master at {where} within hardware.dist_timeout_s="
                              f"{timeout_s:g}; check MASTER_ADDR/MASTER_PORT (or hardware.master_addr/"
                              "master_port) and that node 0 was started")
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    except Exception as exc:  # noqa: BLE001 - DistStoreError (peers missing), DistNetworkError (port)
        text = launch.first(exc)
        if "clients joined" in text:
            raise UserError(f"{who}: the other ranks did not all join at {where} within hardware."
                            f"dist_timeout_s={timeout_s:g} ({text}); check MASTER_ADDR/MASTER_PORT (or "
                            "hardware.master_addr/master_port) and that every node was started") from None
        raise UserError(f"{who} cannot serve or reach the rendezvous at {where} ({text}); choose a free "
                        "MASTER_PORT (or hardware.master_port)") from None
    store = dist.PrefixStore(f"rlctl/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if store.add(f"claim/{group.rank}", 1) != 1:   # keys fresh for each restart of torchrun's workers
        by = (f"hardware.node_rank={group.node}" if group.source == "rlctl"
              else f"rank {group.rank} ({group.source})")
        raise UserError(f"rank {group.rank} is claimed twice: is {by} started on two machines? "
                        "(start each node once)")
    _STORES.append(store)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=dist.PrefixStore("pg", store),
                            rank=group.rank, world_size=group.world_size, timeout=timedelta(seconds=timeout_s))
    label = f"node {group.node}" if group.node is not None else f"rank {group.rank}"
    flat = same_config.flatten(run_config or {})
    payloads: List[Optional[str]] = [None] * group.world_size
    dist.all_gather_object(payloads, same_config.payload(flat, label))
    ref = json.loads(payloads[0])
    line = same_config.mismatch(ref["label"], ref["config"], payloads[1:])
    if line is not None:
        dist.destroy_process_group()
        raise UserError(line)


def _node(env: Dict[str, str]) -> Optional[int]:
    """The node number the launcher exports (torchrun, and rlctl's launcher through it:
    GROUP_RANK; srun: SLURM_NODEID), if any."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def share(group: Group, value: Optional[str], error: Optional[str] = None) -> str:
    """Rank 0 passes ``value`` (or its ``error`` line) to every rank; the others wait for it
    within the group's timeout and raise that error as theirs."""

    store = dist.distributed_c10d._get_default_store()
    if group.rank == 0:
        store.set(_KEY, _FAILED + error if error is not None else value)
        return value
    try:
        got = store.get(_KEY).decode()
    except Exception as exc:  # noqa: BLE001 - the store's timeout or a lost master
        raise UserError(f"rank {group.rank}: rank 0 did not share the run directory "
                        f"({' '.join(str(exc).split())[:160]})") from None
    if got.startswith(_FAILED):
        raise UserError(f"rank 0 failed: {got[len(_FAILED):]}")
    return got
