"""Controlling the job's processes, for ``run_job``: start the launcher (its output pumped to the
job's log and to the observer), find this launch's rank processes on this node (``ranks.py``), stop
them all (the launcher, its workers, orphans carrying this launch's marker), and say how each rank
ended (``RankExit``)."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from moedoctor import environment
from moedoctor.run_records import RankExit
from moedoctor.runner import procs, ranks
from moedoctor.runner.command import is_torchrun
from moedoctor.runner.manifest import root_cause_rank
from moedoctor.runner.progress import ProgressTracker

if TYPE_CHECKING:
    from moedoctor.runner.launch import RunConfig, RunObserver

#: Marks every process of one launch, so orphans of a dead launcher are still found and stopped.
ENV_LAUNCH_ID = environment.LAUNCH_ID.name


class JobControl:
    """The launcher's process and this launch's rank processes on this node."""

    def __init__(self, config: RunConfig, observer: RunObserver, launch_id: str, tracker: ProgressTracker):
        self.config = config
        self.observer = observer
        self.launch_id = launch_id
        self.tracker = tracker
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, procs.JobProcess] = {}  # rank -> worker process, on this node
        self._local: dict[int, tuple[int, bool]] = {}  # rank -> (pid, whether it is this launch's)
        self.log_lock = threading.Lock()
        self.started = time.monotonic()

    @property
    def marker(self) -> tuple[str, str]:
        """This launch's marker in its processes' environment."""
        return (ENV_LAUNCH_ID, self.launch_id)

    def start(self, env: dict[str, str], preexec_fn, log) -> list[threading.Thread]:
        """Start the launcher (OSError when it cannot be) and the threads that pump its output."""
        self.proc = subprocess.Popen(
            self.config.command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
        self.started = time.monotonic()
        pumps = [
            threading.Thread(target=self._pump, args=(pipe, n, log), daemon=True, name=f"moedoctor-pump-{n}")
            for n, pipe in ((1, self.proc.stdout), (2, self.proc.stderr))
        ]
        for pump in pumps:
            pump.start()
        return pumps

    def _pump(self, pipe, stream: int, log) -> None:
        fd = pipe.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            with self.log_lock:
                log.write(data)
            try:
                self.observer.output(data, stream)
            except Exception:
                pass  # a closed terminal must not stop the job's log
        pipe.close()

    def is_local(self, rank: int) -> bool:
        """A rank of this launch (a shared run directory holds the other nodes' traces too)."""
        t = self.tracker.ranks.get(rank)
        if t is None:
            return False
        known = self._local.get(rank)
        if known is None or known[0] != t.pid:
            env = procs.environ(t.pid) if t.host == self.config.host else None
            known = self._local[rank] = (t.pid, (env or {}).get(ENV_LAUNCH_ID) == self.launch_id)
        return known[1]

    def scan(self) -> None:
        self.seen.update(self.local_ranks())

    def local_ranks(self) -> dict[int, procs.JobProcess]:
        """This launch's rank processes on this node (ranks.py: from the traces, then ``RANK``)."""
        assert self.proc is not None
        return ranks.local_ranks(self.proc.pid, self.marker, self.tracker.ranks, self.config.host)

    def local_pids(self) -> dict[int, int]:
        """rank -> pid of every traced rank on this host (the trace header's pid)."""
        return {r: t.pid for r, t in self.tracker.ranks.items() if t.host == self.config.host}

    def leftovers(self) -> bool:
        """Processes of this launch still alive (the launcher gone, its workers left behind)."""
        assert self.proc is not None
        return bool(procs.job_processes(self.proc.pid, self.marker))

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, marker = self.proc, self.marker
        procs.stop_processes(lambda: procs.job_processes(proc.pid, marker), self.config.stop_grace)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def world_size(self) -> int | None:
        sizes = [p.world_size for p in self.seen.values() if p.world_size]
        return self.tracker.world_size() or (max(sizes) if sizes else None)

    def rank_exits(self, launcher_exit: int | None, log_path: str | None) -> list[RankExit]:
        # This node's ranks: those seen in its launch (other nodes may share the host).
        torchrun = is_torchrun(self.config.command)
        log = _log_tail(log_path) if torchrun and launcher_exit not in (None, 0) else ""
        reported, first = (_torchrun_failures(log), root_cause_rank(log)) if log else ({}, None)
        root = self.proc.pid if self.proc is not None else None
        return ranks.rank_exits(self.seen, root, launcher_exit, torchrun, reported, self.config.host, first)


def _log_tail(path: str | None, size: int = 1 << 20) -> str:
    try:
        with open(path or "", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_failures(log: str) -> dict[int, int]:
    """Exit codes of failed ranks, from torchrun's own failure report (``ChildFailedError``)."""
    return {int(rank): int(code) for rank, code in _FAILURE.findall(log)}
