"""The run directory: the unit of capture (manifest, per-rank traces, stacks, GPU snapshots, the
job's log), and the rules for choosing, reusing and joining one.

A run directory belongs to one job. Each node's live supervisor holds an exclusive ``fcntl.flock``
on ``supervisor-node<R>.lock`` (R: its ``--node_rank``) for as long as it lives; the kernel releases
it when the process dies, however it dies. So a second ``moedoctor run`` of the same node on the
same directory is refused (naming the pid that holds it), another node of the same job (same
command up to ``--node_rank``, so the same rendezvous id) joins, and a manifest left ``running`` by a
supervisor that was killed (no lock held) is stale: the directory is then a finished run, reused
only with ``--force``, which is refused too while any supervisor holds a lock there."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path

from moedoctor import layout
from moedoctor.errors import EXIT_USAGE, MoedoctorError
from moedoctor.manifest_format import Manifest, Status
from moedoctor.layout import RunDir  # noqa: F401 - the layout is a shared leaf; re-exported here
from moedoctor.run_records import HELD_LOCKS, LOCK_GLOB, held_by_others, lock_holder, supervisor_alive  # noqa: F401
from moedoctor.runner.command import node_rank, same_job

MANIFEST_NAME = layout.MANIFEST
#: What ``--force`` clears from a reused run directory; other files of the user's are left alone.
_OWN_ENTRIES = layout.OWN_ENTRIES


def default_run_dir(base: Path, now: datetime | None = None) -> Path:
    """A new timestamped folder under ``base`` (``base/20250101-120000``, ``-2``, ... if taken)."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    candidate, n = base / stamp, 1
    while candidate.exists():
        n += 1
        candidate = base / f"{stamp}-{n}"
    return candidate


def lock_path(path: Path, command: list[str]) -> Path:
    """The lock file of the node that runs ``command`` in the run directory ``path``."""
    rank = "".join(c if c.isalnum() or c in "-_" else "_" for c in node_rank(command))[:32]
    return Path(path) / layout.lock_name(rank)


def _acquire(lock: Path) -> str | None:
    """Take ``lock`` for the life of this process; None when taken (or already ours), else who holds it."""
    if str(lock) in HELD_LOCKS:
        return None
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = lock_holder(fd)
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    HELD_LOCKS[str(lock)] = fd
    return None


def release(lock: Path) -> None:
    """Give up a lock this process holds (the kernel does it anyway when the process exits)."""
    fd = HELD_LOCKS.pop(str(lock), None)
    if fd is not None:
        os.close(fd)


def prepare_run_dir(path: Path, command: list[str], force: bool) -> bool:
    """Make ``path`` ready for a run of ``command`` and lock it for this process; return True when
    joining a run in progress.

    A run directory whose manifest describes a running run of the same job whose supervisor is
    alive (it holds its lock; or it runs on another host, where this one cannot tell) is joined by
    another node of that job (each node runs the same command, up to ``--node_rank``, against one
    shared directory). A node already supervised there is refused, naming the pid. Any other
    non-empty directory is refused unless ``force``, which clears moedoctor's own entries in it (and
    is refused while another supervisor holds a lock there).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise MoedoctorError(f"run directory {path} exists and is not a directory", EXIT_USAGE)
    lock = lock_path(path, command)
    try:
        path.mkdir(parents=True, exist_ok=True)
        holder = _acquire(lock)
    except OSError as e:
        raise MoedoctorError(f"cannot use run directory {path}: {e.strerror or e}", EXIT_USAGE) from None
    if holder is not None:
        raise MoedoctorError(
            f"run directory {path} belongs to a live run: {holder} holds {lock.name} "
            "(the same node of a job cannot run twice in one run directory); choose another "
            "--run-dir",
            EXIT_USAGE,
        )
    try:
        return _prepare_locked(path, command, force)
    except BaseException:
        release(lock)
        raise


def _prepare_locked(path: Path, command: list[str], force: bool) -> bool:
    others = held_by_others(path)
    if not any(p for p in path.iterdir() if not p.match(LOCK_GLOB)):
        # Only lock files: empty, or another node of the job started at the same moment and has not
        # written the manifest yet (its lock is held): then this node joins it.
        return bool(others)
    manifest = Manifest.read_or_empty(RunDir(path).manifest)
    running = _running_same_job(manifest, command)
    if running and (others or _remote_nodes_running(manifest)):
        return True
    if others:
        raise MoedoctorError(
            f"run directory {path} belongs to a live run ({others[0]}) of "
            f"{'another' if not running else 'this'} job; choose another --run-dir",
            EXIT_USAGE,
        )
    if not force:
        stale = (
            " (its manifest says 'running' but no supervisor holds it any more: the run ended when "
            "its moedoctor was killed)"
            if manifest.status == Status.RUNNING
            else ""
        )
        raise MoedoctorError(
            f"run directory {path} is not empty{stale}: choose another --run-dir, or pass --force to "
            "replace the run recorded there",
            EXIT_USAGE,
        )
    for pattern in _OWN_ENTRIES:
        for entry in path.glob(pattern):
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return False


def _running_same_job(manifest: Manifest, command: list[str]) -> bool:
    return manifest.status == Status.RUNNING and manifest.command is not None and same_job(manifest.command, command)


def _remote_nodes_running(manifest: Manifest) -> bool:
    """A node of the manifest still running on another host: its lock cannot be tested from here
    (the file system may not share flock), so it is taken as alive."""
    return manifest.node_running_elsewhere(socket.gethostname())
