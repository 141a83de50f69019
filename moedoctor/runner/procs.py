"""The job's processes on this node, found through ``/proc``.

torchrun starts each worker in a session of its own, so signalling the launcher's process group
does not reach them: the job is the launcher's descendants, plus any process that still carries
this launch's marker in its environment (a worker orphaned by a launcher that died first, a Ray
worker). ``rank_processes`` reads a worker's rank from the ``RANK`` / ``LOCAL_RANK`` torchrun put in
its environment; ``ranks.py`` prefers what the ranks' traces say (any launcher).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moedoctor.process_state import FROZEN_STATES, ProcessState  # noqa: F401 - re-exported for the runner

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class JobProcess:
    pid: int
    ppid: int
    rank: int | None
    local_rank: int | None
    world_size: int | None


def stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, or None when it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def wchan(pid: int) -> str | None:
    """The kernel function the process sleeps in (``/proc/PID/wchan``), or None (running,
    unreadable, or hidden by the kernel)."""
    try:
        value = (PROC / str(pid) / "wchan").read_text().strip()
    except OSError:
        return None
    return value if value and value != "0" else None


def process_state(pid: int, readings: int = 3, interval: float = 0.05) -> ProcessState:
    """Read the process's state ``readings`` times, ``interval`` seconds apart (never signals or
    attaches: reading ``/proc`` changes nothing)."""
    samples = []
    start = time.monotonic()
    for i in range(max(1, readings)):
        if i:
            time.sleep(interval)
        st = stat(pid)
        samples.append(st[1] if st else "?")
    return ProcessState("".join(samples), wchan(pid), round(time.monotonic() - start, 3))


def more_readings(before: ProcessState, pid: int, started: float) -> ProcessState:
    """``before`` with one more reading now (after a stack dump: a process stopped before it must
    still be stopped after it); ``started``: the ``time.monotonic()`` of the first reading."""
    st = stat(pid)
    return ProcessState(
        before.samples + (st[1] if st else "?"), before.wchan or wchan(pid), round(time.monotonic() - started, 3)
    )


def environ(pid: int) -> dict[str, str] | None:
    """A process's initial environment, or None when it cannot be read (gone, not ours)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def path_of(pid: int, path: str) -> Path:
    """``path`` as process ``pid`` sees it: a relative path is relative to its working directory."""
    p = Path(path)
    if p.is_absolute():
        return p
    try:
        return Path(os.readlink(PROC / str(pid) / "cwd")) / p
    except OSError:
        return p


def _pids() -> list[int]:
    return [int(e.name) for e in PROC.iterdir() if e.name.isdigit()]


def is_alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    st = stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def job_processes(launcher_pid: int, marker: tuple[str, str] | None = None) -> list[JobProcess]:
    """Live processes of the job: the launcher and its descendants, and (with ``marker``, an
    environment ``(key, value)``) every process whose environment carries it."""
    parents: dict[int, int] = {}
    for pid in _pids():
        st = stat(pid)
        if st is not None and st[1] not in ("Z", "X"):
            parents[pid] = st[0]
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    members = set()
    stack = [launcher_pid] if launcher_pid in parents else []
    while stack:
        pid = stack.pop()
        members.add(pid)
        stack.extend(children.get(pid, ()))
    if marker is not None:
        key, value = marker
        for pid in parents.keys() - members:
            env = environ(pid)
            if env is not None and env.get(key) == value:
                members.add(pid)
    found = []
    for pid in sorted(members):
        env = environ(pid) or {}
        found.append(
            JobProcess(
                pid, parents[pid], _int(env.get("RANK")), _int(env.get("LOCAL_RANK")), _int(env.get("WORLD_SIZE"))
            )
        )
    return found


def rank_processes(processes: list[JobProcess]) -> dict[int, JobProcess]:
    """The worker process of each rank: the topmost process carrying that ``RANK`` (its forked
    children, such as data loader workers, inherit the variable)."""
    by_pid = {p.pid: p for p in processes}
    ranks: dict = {}
    for p in processes:
        if p.rank is None:
            continue
        parent = by_pid.get(p.ppid)
        if parent is not None and parent.rank == p.rank:
            continue
        ranks.setdefault(p.rank, p)
    return ranks


def stop_processes(find: Callable[[], list[JobProcess]], grace: float = 5.0, poll: float = 0.1) -> list[int]:
    """SIGTERM every process ``find()`` returns, SIGKILL whatever is left after ``grace`` seconds
    (and whatever appears meanwhile); return every pid signalled. Returns once none is left, or
    after a few seconds more than ``grace`` if some process cannot be killed."""
    signalled: set[int] = set()

    def send(sig: int, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
                signalled.add(pid)
            except (ProcessLookupError, PermissionError):
                pass

    def wake_stopped(pids: list[int]) -> None:
        # A stopped process (state T) keeps a SIGTERM pending until it runs again: continue it so
        # that it ends now (the shell's ``kill`` does the same), not at the SIGKILL after ``grace``.
        for pid in pids:
            st = stat(pid)
            if st is not None and st[1] == "T":
                try:
                    os.kill(pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass

    first = [p.pid for p in find()]
    send(signal.SIGTERM, first)
    wake_stopped(first)
    deadline = time.monotonic() + grace
    try:
        while time.monotonic() < deadline:
            left = find()
            if not left:
                return sorted(signalled)
            fresh = [p.pid for p in left if p.pid not in signalled]
            send(signal.SIGTERM, fresh)
            wake_stopped(fresh)
            time.sleep(poll)
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: go straight to SIGKILL
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        left = find()
        if not left:
            break
        send(signal.SIGKILL, [p.pid for p in left])
        time.sleep(poll)
    return sorted(signalled)
