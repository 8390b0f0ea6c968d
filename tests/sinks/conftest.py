import os
import socket
import threading
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """No wandb variables or credentials from the developer's environment."""
    for var in list(os.environ):
        if var.startswith("WANDB_"):
            monkeypatch.delenv(var)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))  # does not exist
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return home


class Listener:
    """A local TCP server that counts the connections made to it and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self._held = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self._held.append(conn)

    def close(self):
        self.sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.close()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def inet_sockets_of_process_tree(pid: int | None = None) -> list[str]:
    """Lines of /proc/net/{tcp,tcp6,udp,udp6} owned by `pid` or its descendants."""
    pid = pid or os.getpid()
    inodes = set()
    for p in _descendants(pid):
        inodes |= _socket_inodes(p)
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                found.append(f"{table}: {line.strip()}")
    return found


@pytest.fixture
def inet_sockets():
    """inet_sockets() -> open TCP/UDP sockets of this process and its children."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc")
    return inet_sockets_of_process_tree
