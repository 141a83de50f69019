"""The recorder: one per rank process, fed by Python kernels registered at the dispatcher.

Every collective is written to this rank's trace with ``os.write`` before the op is issued, so the
record survives a SIGKILL or a Gloo SIGABRT a millisecond later. A small background thread notices
completed ``Work`` objects, answers snapshot requests from the watchdog and keeps nothing else.

The kernels sit at the ``BackendSelect`` dispatch key, which is in every thread's default included
set and a fallthrough for these ops: below autograd (so the functional collectives keep their
registered autograd formulas, and their backward collectives are seen too), and still reached where
autograd's guard has excluded everything above the backends: inside DTensor's ``__torch_dispatch__``
(``clip_grad_norm_`` on DTensors), for inference-mode tensors, from C++ callers such as the DDP
reducer and from every thread. A collective issued from inside another one's kernel (a functional
collective calling its process group) is not counted twice. The coverage check compares the counts
with the backend's own sequence counter.

The recorder is three parts: the dispatcher kernels (``kernels.PythonKernels``, or the native ones of
``native/`` behind the ``[native seam]``), record writing (``records.TraceRecords``: the trace, its
lock and numbering, every record but the collective made from the schema's tables) and, here, the
``Recorder`` the evidence hooks (``evidence.py``, ``exceptions.py``) talk to: the phase state they set
(step, optimizer depth, checkpoint, pause) and the records they write. Imports go one way:
``core`` -> ``kernels`` / ``progress`` / ``native`` -> ``records`` -> ``writer``, ``groups``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moedoctor import environment
from moedoctor.events import Phase
from moedoctor.layout import RunDir
from moedoctor.recorder import records as lines
from moedoctor.recorder.groups import process_group
from moedoctor.recorder.kernels import PythonKernels, is_nccl
from moedoctor.recorder.ops import all_specs
from moedoctor.recorder.progress import Progress
from moedoctor.recorder.records import TraceRecords

DEFAULT_MAX_EVENTS = environment.DEFAULT_MAX_EVENTS


class Recorder:
    """Writes this rank's trace. Created by ``install``; opened when the default group exists."""

    def __init__(self, run_dir: Path, max_events: int = DEFAULT_MAX_EVENTS, poll_interval: float = 0.2):
        self.run_dir = Path(run_dir)
        self.max_events = max_events
        self.poll_interval = poll_interval
        self._native: Any = None  # [native seam] NativeKernels while MOEDOCTOR_NATIVE=1 and it loaded
        self.step = 0
        self.optimizer_depth = 0
        #: ``pause()``: no kernel in front of the collectives, every evidence hook passes straight
        #: through (the benchmarks' in-process toggle of the whole recorder).
        self.paused = False
        self.checkpoint: Phase | None = None
        #: The trace, its lock and what its records number.
        self.records = TraceRecords(max_events, events=self._events_recorded, on_stop=self._stopped_writing)
        self._writer = self.records.writer
        self._progress = Progress(self, poll_interval)
        self.fresh = self._progress.fresh  # the kernels hand the progress thread their Work here
        self._kernels = PythonKernels(self)
        self._rank = -1
        self.errors = 0

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._writer.fd is not None

    @property
    def _fd(self) -> int | None:
        return self._writer.fd

    # -- [native seam] state the hot path reads: forwarded to the native kernel when it is active ---

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        if self._native is not None:
            self._native.set_step(value)

    @property
    def optimizer_depth(self) -> int:
        return self._optimizer_depth

    @optimizer_depth.setter
    def optimizer_depth(self, value: int) -> None:
        self._optimizer_depth = value
        if self._native is not None:
            self._native.set_optimizer_depth(value)

    @property
    def checkpoint(self) -> Phase | None:
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, value: Phase | None) -> None:
        self._checkpoint = value
        if self._native is not None:
            self._native.set_checkpoint(value)

    def _use_native(self) -> bool:
        """[native seam] MOEDOCTOR_NATIVE=1 and the extension builds; else the Python kernels."""
        from moedoctor.recorder import native

        if not native.requested():
            return False
        if self._native is None:
            try:
                if native.available():
                    self._native = native.NativeKernels(self)
                    self._writer.before_write = self._native.flush
            except Exception as e:  # never fail the job: the Python kernels record it
                native.reason = f"{type(e).__name__}: {e}"
            if self._native is None:
                print(
                    f"moedoctor: native kernel unavailable, using the Python kernels: {native.reason}", file=sys.stderr
                )
                return False
        return True

    # -- [end native seam] ---------------------------------------------------------------------

    def register_kernels(self) -> None:
        """Put a recording kernel in front of every collective op this torch build has."""
        if self._kernels.registered or (self._native is not None and self._native.registered):
            return
        if self._use_native():  # [native seam]
            self._native.register(all_specs())
            return
        self._kernels.register(all_specs())

    def pause(self) -> None:
        """Record nothing until ``resume()``: the kernels come off the dispatcher, the evidence hooks
        pass through (they stay installed: torch offers no way to remove global hooks) and the
        progress thread idles (it wakes, sees the pause and sleeps again). The benchmarks' in-process
        toggle of the whole recorder; the native kernel's flush thread keeps waking every 2 ms, with
        nothing to write."""
        self.paused = True
        self._progress.idle = True
        self.unregister_kernels()

    def resume(self) -> None:
        self.register_kernels()
        self.paused = False
        self._progress.idle = False

    def unregister_kernels(self) -> None:
        if self._native is not None and self._native.registered:  # [native seam]
            self._native.unregister()
        self._kernels.unregister()

    def open(self) -> None:
        """Create this rank's status and trace files and write the header; start the progress
        thread. Never raises: a file that cannot be created stops the recording (``stop_recording``)."""
        import torch.distributed as dist

        if self._fd is not None or self.stopped is not None:
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        self._rank = rank
        if not self._writer.open(RunDir(self.run_dir).traces, rank):
            return
        if self._native is not None:  # [native seam]
            self._native.set_fd(self._fd)
        self.records.write(lines.header_line(rank, world, self.kernel))
        if self._fd is None:  # the header could not be written: recording stopped already
            return
        self._progress.start()

    def flush(self) -> None:
        """Write what the native kernel buffered (``os._exit``'s wrapper calls it: no atexit runs)."""
        if self._native is not None and self._fd is not None:  # [native seam]
            self._native.flush()

    def before_finalization(self) -> None:
        """The interpreter is about to finalize (the last atexit handler of ours): from now on the
        native kernel leaves the Works it held alive instead of destroying them. A tensor's
        destruction lets go of the GIL for a moment, and a daemon thread (the progress thread, if
        it was still in a call) that takes the GIL back while the interpreter finalizes is ended
        inside that destructor: ``std::terminate``, the job killed by SIGABRT after it finished."""
        if self._native is not None:  # [native seam]
            self._native.stop_releasing()

    def close(self, reason: str) -> None:
        """Write the coverage record and stop the progress thread (once)."""
        if self._fd is None or self._progress.stopping:
            return
        self._progress.finish()
        self.write_coverage(reason)

    # -- output ----------------------------------------------------------------------------------

    @property
    def stopped(self) -> str | None:
        """Why recording stopped (a write of ours failed); None while it runs."""
        return self._writer.stopped

    def stop_recording(self, error: OSError) -> None:
        """A write of ours failed: write nothing more; the job goes on (``TraceWriter.stop``)."""
        self._writer.stop(error)

    def _stopped_writing(self) -> None:
        if self._native is not None:  # [native seam]
            self._native.set_fd(None)
        self._progress.clear()

    @property
    def kernel(self) -> str:
        """The kernel recording now: ``native`` while the C++ kernels are registered, else ``python``."""
        return "native" if self._native is not None and self._native.registered else "python"

    def _events_recorded(self) -> int:
        """Collectives and p2p ops recorded so far (on either kernel)."""
        if self._native is not None and self._native.registered:  # [native seam] counters live in C++
            try:
                return sum(c + p for c, p in self._native.counts()[0].values())
            except Exception:  # noqa: BLE001 - only a number in a message
                return self.records.next_event
        return self.records.next_event

    # -- what the evidence hooks write -----------------------------------------------------------

    def write_evidence(self, kind: str, data: dict | None = None, step: int | None = None) -> None:
        if self._fd is None:
            return
        line = lines.evidence_line(kind, self.step if step is None else step, data)
        native = self._native
        with self.records.lock:
            if native is not None:  # [native seam] buffered with the kernels' records: no write(2) here
                native.append(line)
            else:
                self.records.write(line)

    def write_record(self, record: dict) -> None:
        """Write one record other than a collective (an exception, made with ``schema.fields``) at
        once: the native kernel's buffered records first, then this one with one ``os.write``. Gives
        up after a second if a thread holds the lock (the process may be going down with it)."""
        if self._fd is None:
            return
        if self.records.lock.acquire(timeout=1.0):
            try:
                self.records.write(lines.encode(record))
            finally:
                self.records.lock.release()

    def defer(self, ready: Callable[[], bool], emit: Callable[[], None]) -> None:
        """Have the progress thread call ``emit`` once ``ready()`` is true (a GPU value has landed)."""
        self._progress.defer(ready, emit)

    def write_coverage(self, reason: str) -> None:
        """Compare each group's recorded count with the backend's own sequence counter (NCCL's
        counts collectives only; Gloo's counts p2p ops too)."""
        from torch.distributed.distributed_c10d import _world

        records = self.records
        counts: dict[str, tuple[int, int]] = {}
        dropped = records.dropped
        kernel = self.kernel
        if kernel == "native":  # [native seam] counters live in C++
            counts, dropped = self._native.counts()
        groups = []
        for pg, name in list(_world.pg_names.items()):
            try:
                backend = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
            except Exception:
                backend = None
            collectives, p2p = counts.get(name) or (records.seq.get(name, 0), records.p2p_count(name))
            groups.append([name, collectives + (0 if is_nccl(pg) else p2p), backend])
        records.write_locked(lines.coverage_line(reason, groups, dropped, kernel))

    def internal_error(self, op: str, error: Exception | str, native: bool = False) -> None:
        """A failure of ours while recording ``op``: the first three become ``recorder_error`` evidence."""
        self.errors += 1
        if self.errors <= 3:
            data: dict[str, Any] = {"op": op, "error": error if isinstance(error, str) else repr(error)}
            if native:
                data["native"] = True
            self.write_evidence("recorder_error", data)

    @staticmethod
    def process_group(name: str):
        """The process group named ``name``, or None."""
        return process_group(name)
