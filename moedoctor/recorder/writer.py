"""This rank's trace file and its status file (``moedoctor.trace.format``): records appended with
``os.write`` on an ``O_APPEND`` descriptor, and on the first failed write (disk full, read-only,
quota) recording stops for good, said in the status file, while the job goes on."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from moedoctor.trace import format as fmt


class TraceWriter:
    """Owns the trace's and the status file's descriptors. ``events`` counts the collectives recorded
    so far (for the status line); ``on_stop`` runs once when recording stops, before it is said."""

    def __init__(self, events: Callable[[], int], on_stop: Callable[[], None]):
        self.fd: int | None = None
        self.path: Path | None = None
        self.rank = -1
        self.stopped: str | None = None  # why recording stopped (a write of ours failed); None while it runs
        #: Called before every write: the native kernel's buffered records go first, so the file keeps
        #: the order records were made in.
        self.before_write: Callable[[], None] | None = None
        self._events, self._on_stop = events, on_stop
        self._status_fd: int | None = None  # traces/rank-N.status, reserved at open
        self._stop_lock = threading.Lock()

    def open(self, traces: Path, rank: int) -> bool:
        """Create the status and trace files; False (recording stopped, said) when they cannot be."""
        self.rank = rank
        path = self.path = traces / fmt.trace_file_name(rank)
        try:
            traces.mkdir(parents=True, exist_ok=True)
            try:
                self._status_fd = fmt.reserve_status(traces, rank, os.getpid())
            except OSError:
                self._status_fd = None  # a failure is then said on stderr only
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self.stop(e)
            return False
        return True

    def write(self, data: bytes) -> None:
        """Append to the trace; a failed write stops the recording."""
        fd = self.fd
        if fd is None:
            return
        if self.before_write is not None:
            self.before_write()
        try:
            while data:
                written = os.write(fd, data)
                data = data[written:]
        except OSError as e:
            self.stop(e)

    def stop(self, error: OSError) -> None:
        """A write of ours failed: write nothing more (the job goes on), and say so once, in this
        rank's status file (rewritten in bytes reserved at open, so a full disk still takes it) or,
        where even that fails, on stderr. The trace's descriptor stays open: a native kernel may be
        writing to it right now, and a closed number could be reused by the job."""
        with self._stop_lock:
            if self.stopped is not None:
                return
            self.fd = None  # the kernels, the progress thread and the evidence hooks check it
            self._on_stop()
            file = self.path.name if self.path is not None else "its trace"
            events = self._events()
            status = {
                "rank": self.rank,
                "errno": error.errno,
                "error": error.strerror or str(error),
                "file": file,
                "events": events,
            }
            self.stopped = fmt.stopped_line(status)
            try:
                if self._status_fd is None:
                    raise OSError("no status file")
                fmt.stop_status(self._status_fd, self.rank, os.getpid(), error, file, events)
            except OSError:
                try:
                    print(f"moedoctor: {self.stopped}", file=sys.stderr, flush=True)
                except Exception:  # noqa: BLE001 - a closed stderr: nothing left to tell it with
                    pass
