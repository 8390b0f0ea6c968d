"""Ranks started through torchrun's launcher, signals forwarded, and the group a launcher made."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from rlctl.config.compose import flatten
from rlctl.errors import LaunchError, UserError, one_line

EXIT_SETUP = 3          # a rank failed before its first training step (set-up)
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)
KILLED = (-signal.SIGINT, -signal.SIGTERM)   # a rank the signal reached before its handler
_OWN_HINT = "hardware.master_addr/master_port"            # what to check, by who started the ranks
_ENV_HINT = f"MASTER_ADDR/MASTER_PORT (or {_OWN_HINT})"
for _name in ("torch.distributed.elastic", "torch.distributed.launcher"):   # rlctl says what failed
    logging.getLogger(_name).addHandler(logging.NullHandler())
    logging.getLogger(_name).propagate = False


def _error_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f".rank{rank}.error"


def write_error(run_dir: Path, message: str, code: int) -> None:
    """A rank's one-line error and exit code, for the launcher to report."""
    rank = int(os.environ.get("RANK", 0))
    _error_file(run_dir, rank).write_text(json.dumps({"message": message, "code": code}))


def launch(num_processes: int, run_dir: Path, threads: int, resume: bool = False, stop=None,
           poll_s: float = 0.2) -> int:
    """Run the ranks to the end: 0, or the forwarded signal's number; LaunchError if one failed."""
    for rank in range(num_processes):
        _error_file(run_dir, rank).unlink(missing_ok=True)
    layout = dict(min_nodes=1, max_nodes=1, nproc_per_node=num_processes, rdzv_backend="c10d",
                  rdzv_endpoint="localhost:0", rdzv_configs={})
    args = [sys.executable, "-m", "rlctl.train.worker", str(run_dir)] + (["--resume"] if resume else [])
    codes = _run_agent(layout, threads, args, stop, poll_s)
    rank = _failed(codes, stop)
    if rank is not None:
        raise _failure(run_dir, rank, codes[rank])
    return stop.signum if codes else 0


def node_argv(overrides: List[str], recipe, resume) -> List[str]:
    """The `rlctl train` command line each rank of a node runs."""
    head = [sys.executable, "-m", "rlctl.cli", "train"]
    if resume is not None:
        head += ["--resume", str(resume)]
    elif recipe is not None:
        head += ["--recipe", str(recipe)]
    return head + list(overrides)


def launch_node(argv: List[str], hw, stop=None, poll_s: float = 0.2) -> int:
    """Node ``hw.node_rank`` of ``hw.nnodes``: its ``hw.num_processes`` ranks each run ``argv``.
    The first failed rank's exit code (it printed its line), 128 + signal after a forwarded
    stop, else 0; a rendezvous not formed within ``hw.dist_timeout_s`` is a UserError."""
    if hw.node_rank >= hw.nnodes:
        raise LaunchError(f"hardware.node_rank={hw.node_rank} must be below hardware.nnodes="
                          f"{hw.nnodes} (nodes are numbered 0 .. nnodes-1)", True, 2)
    n, timeout, where = hw.num_processes, hw.dist_timeout_s, f"{hw.master_addr}:{hw.master_port}"
    world = hw.nnodes * n
    who = f"rank {_span(hw.node_rank * n, hw.node_rank * n + n)} of {world} (rlctl)"
    if hw.node_rank:
        wait_reachable(hw.master_addr, hw.master_port, timeout, stop, who, _OWN_HINT)
    layout = dict(min_nodes=hw.nnodes, max_nodes=hw.nnodes, nproc_per_node=n, rdzv_backend="static",
                  rdzv_endpoint=where, rdzv_configs={"rank": hw.node_rank, "timeout": max(1, round(timeout))})
    try:
        codes = _run_agent(layout, hw.num_threads, argv, stop, poll_s, run_id="rlctl")
    except Exception as exc:  # noqa: BLE001 - the agent's store: port taken, or nodes missing
        text = one_line(exc)[:160]
        if "clients joined" in text:
            joined = int(text.split("clients joined")[0].split()[-1].split("/")[0])
            missing = (f"rank(s) {_span(n, world)}" if joined == 1
                       else f"{hw.nnodes - joined} node(s)")
            raise UserError(f"rank 0 of {world} (rlctl): the other ranks did not all join at {where} "
                            f"within hardware.dist_timeout_s={timeout:g}: {missing} never connected; "
                            f"check {_OWN_HINT} and that every node was started") from None
        raise UserError(f"{who}: the rendezvous at {where} failed ({text}); "
                        "choose a free hardware.master_port") from None
    rank = _failed(codes, stop)
    return codes[rank] if rank is not None else (128 + stop.signum if codes else 0)


def _failed(codes: Dict[int, int], stop) -> Optional[int]:
    """The first failed rank; None when all finished or on a stop (128 + signal, or killed)."""
    stopping = stop is not None and stop.requested
    if stopping and any(c in KILLED for c in codes.values()):
        return None
    return next((r for r, c in codes.items() if not (stopping and c in STOPPED)), None)


def _run_agent(layout: dict, threads: int, args: List[str], stop, poll_s: float,
               run_id: Optional[str] = None) -> Dict[int, int]:
    """torchrun's agent in a thread running ``args`` in each rank, signals forwarded ->
    {rank: exit code} of the failed ranks, first failure first ({}: all finished)."""
    logs = tempfile.mkdtemp(prefix="rlctl-launch-")
    launch_config = LaunchConfig(run_id=run_id or uuid.uuid4().hex, max_restarts=0, monitor_interval=0.1,
                                 logs_specs=DefaultLogsSpecs(log_dir=logs), **layout)
    env = [f"RLCTL_LAUNCHER_PID={os.getpid()}", f"OMP_NUM_THREADS={threads}",
           "TORCH_CPP_LOG_LEVEL=" + os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")]
    result: list = []

    def agent():
        try:
            result.append(elastic_launch(launch_config, shutil.which("env") or "/usr/bin/env")(
                *env, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the launching thread
            result.append(exc)
    thread = threading.Thread(target=agent, name="rlctl-launch", daemon=True)
    sent: set = set()
    if stop is not None:
        stop.forward = lambda signum: _signal(_ranks(thread), signum, sent)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(poll_s)
            if stop is not None and stop.requested:     # ranks started after the signal get it too
                _signal([p for p in _ranks(thread) if p not in sent], stop.signum, sent)
    except BaseException:
        _signal(_ranks(thread), signal.SIGKILL, sent)   # a second Ctrl-C: abandon at once
        thread.join(60)
        raise
    finally:
        if stop is not None:
            stop.forward = None
        shutil.rmtree(logs, ignore_errors=True)
    got = result[0]
    if isinstance(got, ChildFailedError):
        order = sorted(got.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
        return {rank: failure.exitcode for rank, failure in order}
    if isinstance(got, BaseException):
        raise got
    return {}


def _ranks(thread: threading.Thread) -> List[int]:
    """The pids of the ranks the agent thread started (its children, Linux /proc)."""
    try:
        tid = thread.native_id
        return [int(p) for p in Path(f"/proc/{os.getpid()}/task/{tid}/children").read_text().split()]
    except (OSError, TypeError, ValueError):
        return []


def _signal(pids: List[int], signum: int, sent: set) -> None:
    for pid in pids:
        sent.add(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _failure(run_dir: Path, rank: int, code: int) -> LaunchError:
    """The failed rank's own message (the lowest rank's), else its exit code and last log line."""
    setup = code == EXIT_SETUP
    for r in sorted({0, rank}):
        try:
            err = json.loads(_error_file(run_dir, r).read_text())
            return LaunchError(str(err["message"]), setup, int(err["code"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    log, last = run_dir / f"rank{rank}.log", ""
    if rank and log.is_file():
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        last = f": {lines[-1][:200]}" if lines else ""
    where = f"see {log}" if rank else "see the output above"
    return LaunchError(f"rank {rank} exited with code {code}{last} ({where})", setup)


def leave_with_launcher() -> None:
    """SIGTERM when the launcher dies: the rank saves after its step and leaves."""
    launcher = os.environ.get("RLCTL_LAUNCHER_PID")
    if launcher:
        die_with_parent(int(launcher))


def die_with_parent(parent: int) -> None:
    """SIGTERM to this process when ``parent`` dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):       # not Linux: the parent's own kill still applies
        return
    if os.getppid() != parent:              # it died before the request
        os.kill(os.getpid(), signal.SIGTERM)


def wait_reachable(host: str, port: int, timeout: float, stop, who: str, hint: str) -> None:
    """Return once ``host:port`` accepts a connection; UserError naming ``who`` and ``hint``
    after ``timeout`` s; LaunchError (exit 128 + signal) once ``stop`` holds a signal."""
    deadline = time.monotonic() + timeout
    while True:
        if stop is not None and stop.requested:
            raise LaunchError(f"interrupted by {signal.Signals(stop.signum).name} while waiting for "
                              f"node 0 at {host}:{port}; nothing was trained", True, 128 + stop.signum)
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))
                                     ).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UserError(f"{who}: it cannot reach the master at {host}:{port} within "
                                f"hardware.dist_timeout_s={timeout:g}; check {hint} and that node 0 "
                                f"was started ({one_line(exc)[:160]})") from None
            time.sleep(0.2)


def _span(lo: int, hi: int) -> str:
    """Ranks lo .. hi - 1 as '2-3' (or '2')."""
    return str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}"


# ---- a launcher's group --------------------------------------------------------------------
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
    node: Optional[int] = None  # this rank's node, where the launcher says


def expand_nodelist(nodelist: str) -> List[str]:
    """SLURM's host list -> names: ``node[01-03,07],login`` -> node01-node03, node07, login."""
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
        keys, addr = ("RANK", "WORLD_SIZE", "LOCAL_RANK"), env["MASTER_ADDR"]
        source = "rlctl" if "RLCTL_LAUNCHER_PID" in env else "torchrun/deepspeed"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        keys, source = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "SLURM"
        addr = env.get("MASTER_ADDR") or expand_nodelist(env.get("SLURM_JOB_NODELIST", "") or
                                                         env.get("SLURM_NODELIST", ""))[0]
    else:
        return None
    rank, size, local = (_int(env, k) if k in env else 0 for k in keys)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else default_port
    if size < 1 or not 0 <= rank < size:
        raise UserError(f"the launcher's rank {rank} is not in [0, {size}) "
                        f"(world size {size}, from {source})")
    node = next((int(env[k]) for k in ("GROUP_RANK", "SLURM_NODEID") if env.get(k, "").isdigit()),
                None)    # the node number the launcher exports (torchrun; srun)
    return Group(rank, size, local, addr, port, source, node)


def join(group: Group, device: str, timeout_s: float,
         run_config: Optional[Dict[str, Any]] = None, stop=None) -> None:
    """Export ``group`` to the environment, join it (gloo; nccl on CUDA) within ``timeout_s``
    (a ``stop`` signal ends the wait for the master), then compare every rank's ``run_config``
    (nested dicts) with rank 0's in one ``all_gather_object``: one line on every rank."""
    os.environ.update({"RANK": str(group.rank), "WORLD_SIZE": str(group.world_size),
                       "LOCAL_RANK": str(group.local_rank), "MASTER_ADDR": group.master_addr,
                       "MASTER_PORT": str(group.master_port)})
    if dist.is_initialized():
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(group.local_rank)
    who = f"rank {group.rank} of {group.world_size} ({group.source})"
    where = f"{group.master_addr}:{group.master_port}"
    if group.rank:
        wait_reachable(group.master_addr, group.master_port, timeout_s, stop, who, _ENV_HINT)
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    except Exception as exc:  # noqa: BLE001 - DistStoreError (peers missing), DistNetworkError (port)
        text = one_line(exc)[:160]
        if "clients joined" in text:
            raise UserError(f"{who}: the other ranks did not all join at {where} within hardware."
                            f"dist_timeout_s={timeout_s:g} ({text}); check {_ENV_HINT} and that "
                            "every node was started") from None
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
    payloads: List[Optional[str]] = [None] * group.world_size
    dist.all_gather_object(payloads, payload(compared(run_config or {}), label))
    line = mismatch(payloads)
    if line is not None:
        dist.destroy_process_group()
        raise UserError(line)


def share(group: Group, value: Optional[str], error: Optional[str] = None) -> str:
    """Rank 0 passes ``value`` (or its ``error`` line) to every rank; the others raise that error."""
    store = dist.distributed_c10d._get_default_store()
    if group.rank == 0:
        store.set(_KEY, _FAILED + error if error is not None else value)
        return value
    try:
        got = store.get(_KEY).decode()
    except Exception as exc:  # noqa: BLE001 - the store's timeout or a lost master
        raise UserError(f"rank {group.rank}: rank 0 did not share the run directory "
                        f"({one_line(exc)[:160]})") from None
    if got.startswith(_FAILED):
        raise UserError(f"rank 0 failed: {got[len(_FAILED):]}")
    return got


# ---- the same config on every node --------------------------------------------------------
# Keys legitimately per node, left out of the comparison: which node and how it reaches node
# 0, its threads and wait, its model cache, and what only rank 0 uses (run directory, loggers).
PER_NODE = ("hardware.node_rank", "hardware.master_addr", "hardware.master_port",
            "hardware.num_threads", "hardware.dist_timeout_s", "model.cache_dir", "run.name",
            "run.output_dir", "run.dir")
PER_NODE_PREFIXES = ("logger.",)
_SHOWN = 3                     # differing keys named in the line; the rest are counted
_UNSET = object()


def compared(tree: Dict[str, Any]) -> Dict[str, Any]:
    """``tree``'s leaves by dotted key, per-node keys left out."""
    return {k: v for k, v in flatten(tree).items()
            if k not in PER_NODE and not k.startswith(PER_NODE_PREFIXES)}


def payload(flat: Dict[str, Any], label: str) -> str:
    """What a rank hands to the others: where it runs, its config and the config's digest."""
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()
    return json.dumps({"label": label, "digest": digest, "config": flat}, default=str)


def show(value: Any) -> str:
    """A value as an override would spell it (true, null, 0.0001, [a, b]), or unset."""
    if value is _UNSET:
        return "unset"
    return value if isinstance(value, str) else json.dumps(value, default=str)


def mismatch(payloads: List[str]) -> Optional[str]:
    """The one line naming the keys where a rank's config differs from rank 0's (``payloads``:
    every rank's, rank 0's first), or None when every digest equals rank 0's."""
    ref, *others = map(json.loads, payloads)
    own, own_label, seen, parts = ref["config"], ref["label"], set(), []
    for got in others:
        if got["digest"] == ref["digest"]:
            continue
        theirs = got["config"]
        for key in sorted(set(own) | set(theirs)):
            a, b = own.get(key, _UNSET), theirs.get(key, _UNSET)
            entry = (key, show(b), got["label"])
            if a != b and entry not in seen:      # several ranks of one node: named once
                seen.add(entry)
                parts.append(f"{key} is {show(a)} on {own_label} and {show(b)} on {got['label']}")
    if not parts:
        return None
    more = f" (and {len(parts) - _SHOWN} more)" if len(parts) > _SHOWN else ""
    return (f"config differs between nodes: {', '.join(parts[:_SHOWN])}{more}; start every node "
            "with the same config")
