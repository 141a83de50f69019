"""Find the ranks of a job that carries no ``RANK`` in any process's environment (a Ray actor sets it in
``os.environ`` at run time, ``mp.spawn`` passes it as an argument), from what the processes show.

What exists, in the order trusted:

1. moedoctor's traces, when the processes run under ``moedoctor run``: each trace's header names its
   pid and rank.
2. The process group's rendezvous store, seen in ``/proc``: ``init_process_group`` with a
   ``MASTER_ADDR``/``MASTER_PORT`` (or ``tcp://``) rendezvous starts a ``TCPStore`` server in rank 0's
   process, and every rank (rank 0 too) connects to it as a client. So the store's port is one that a
   process listens on *and* is connected to itself; the group's members are the processes connected
   to it. The listener is rank 0 if it also talks to another member directly (the backend's own
   connections: Gloo's pairs, NCCL's bootstrap), which a launcher hosting the store (torchrun's agent)
   does not. With two members the other is rank 1; with more, their ranks are not known from this
   (they are numbered from ``UNKNOWN_BASE`` and said to be unidentified).

Only local processes are seen: a store on another host, or members on other hosts, are not.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor import environment
from moedoctor.layout import RunDir
from moedoctor.runner import procs
from moedoctor.trace.reader import trace_paths

#: Ranks that could not be identified are numbered from here, so they are never taken for real ones.
UNKNOWN_BASE = 1000
_LISTEN, _ESTABLISHED = "0A", "01"
_SOCKET = re.compile(r"socket:\[(\d+)\]")


@dataclass(frozen=True, slots=True)
class Socket:
    local_port: int
    remote_port: int
    state: str


@dataclass
class Discovery:
    """The ranks found (rank -> pid), the world size if known, how they were identified, and the
    pids whose rank could not be identified (numbered from ``UNKNOWN_BASE`` in ``ranks``)."""

    ranks: dict[int, int] = field(default_factory=dict)
    world_size: int | None = None
    how: str = ""
    unidentified: list[int] = field(default_factory=list)

    def notes(self) -> list[str]:
        out = [self.how] if self.how else []
        if self.unidentified:
            out.append(
                f"the rank of pid(s) {', '.join(map(str, self.unidentified))} could not be identified: numbered "
                f"from {UNKNOWN_BASE} in this report, so no real rank is named after them"
            )
        return out


def _tcp_table() -> dict[str, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of every TCP socket of this network namespace."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (procs.PROC / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            try:
                table[parts[9]] = (int(parts[1].rsplit(":", 1)[1], 16), int(parts[2].rsplit(":", 1)[1], 16), parts[3])
            except (ValueError, IndexError):
                continue
    return table


def sockets(pid: int, table: dict[str, tuple[int, int, str]]) -> list[Socket]:
    """The TCP sockets process ``pid`` holds open (empty when its fds cannot be read)."""
    found = []
    fd_dir = procs.PROC / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return []
    for fd in fds:
        try:
            m = _SOCKET.match(os.readlink(fd_dir / fd))
        except OSError:
            continue
        if m and m.group(1) in table:
            found.append(Socket(*table[m.group(1)]))
    return found


def _uses_torch(pid: int) -> bool:
    try:
        with open(procs.PROC / str(pid) / "maps", "rb") as f:
            return any(b"libtorch" in line for line in f)
    except OSError:
        return False


def from_store(pid: int, candidates: list[int]) -> Discovery | None:
    """The group of ``pid`` (a rank), or of the first rank among ``candidates`` (a driver's or
    launcher's descendants), through its rendezvous store. None when no store is seen."""
    table = _tcp_table()
    socks = {p: sockets(p, table) for p in procs_alive()}
    listeners: dict[int, int] = {}
    for p, ss in socks.items():
        for s in ss:
            if s.state == _LISTEN:
                listeners.setdefault(s.local_port, p)
    for start in [pid, *candidates]:
        for s in socks.get(start, ()):
            if s.state != _ESTABLISHED:
                continue
            port = s.remote_port
            server = listeners.get(port)
            if server is None or not _is_store(server, port, socks) or not _uses_torch(server):
                continue
            members = sorted(p for p, ss in socks.items() if _connected_to(ss, port) and _uses_torch(p))
            if len(members) >= 2 and start in members:
                return _number(server, port, members, socks)
    return None


def procs_alive() -> list[int]:
    return [p for p in procs._pids() if procs.is_alive(p)]


def _connected_to(ss: list[Socket], port: int) -> bool:
    return any(s.state == _ESTABLISHED and s.remote_port == port for s in ss)


def _is_store(server: int, port: int, socks: dict[int, list[Socket]]) -> bool:
    """The server is a client of its own listening port: a TCPStore hosted by rank 0."""
    return _connected_to(socks.get(server, []), port)


def _number(server: int, port: int, members: list[int], socks: dict[int, list[Socket]]) -> Discovery:
    ports = {p: {s.local_port for s in socks[p] if s.state in (_LISTEN, _ESTABLISHED)} for p in members}

    def talks_directly(a: int, b: int) -> bool:  # a connection between a and b, not through the store
        return any(
            s.state == _ESTABLISHED and s.remote_port in ports[b] and s.remote_port != port and s.local_port != port
            for s in socks[a]
        )

    others = [p for p in members if p != server]
    world = len(members)
    if not any(talks_directly(server, p) or talks_directly(p, server) for p in others):
        unknown = {UNKNOWN_BASE + i: p for i, p in enumerate(members)}
        how = (
            f"ranks found through their rendezvous store (port {port}, {world} local members); its server "
            f"(pid {server}) is no rank's peer, so no rank is identified"
        )
        return Discovery(unknown, None, how, list(members))
    ranks = {0: server}
    unidentified = []
    if len(others) == 1:
        ranks[1] = others[0]
    else:
        for i, p in enumerate(others):
            ranks[UNKNOWN_BASE + i] = p
            unidentified.append(p)
    how = (
        f"ranks found through their rendezvous store (port {port}, hosted by rank 0, pid {server}): "
        f"{world} local members" + ("; the other is rank 1" if len(others) == 1 else "")
    )
    return Discovery(ranks, world, how, unidentified)


def from_traces(pids: list[int]) -> Discovery | None:
    """Ranks named by moedoctor's traces (processes under ``moedoctor run``): header pid -> rank."""
    by_dir: dict[Path, list[int]] = {}
    for p in pids:
        env = procs.environ(p) or {}
        named = environment.run_dir(env)
        if named:
            by_dir.setdefault(procs.path_of(p, named), []).append(p)
    for run_dir, members in by_dir.items():
        ranks, world = {}, None
        for path in trace_paths(RunDir(run_dir).traces):
            try:
                with open(path) as f:
                    header = json.loads(f.readline())
            except (OSError, ValueError):
                continue
            if header.get("pid") in members and isinstance(header.get("rank"), int):
                ranks[header["rank"]] = header["pid"]
                world = header.get("world_size") or world
        if ranks:
            return Discovery(ranks, world, f"ranks read from moedoctor's traces in {run_dir}")
    return None
