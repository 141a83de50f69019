"""The recorder's background thread (``moedoctor-progress``, one per rank): it notices completed
``Work`` objects and writes ``d`` records (and the reduce op of a c10d collective still running, as an
``a`` record), reads Flight Recorder for the collectives whose ``Work`` cannot be watched, writes
evidence whose value waits on the GPU, and answers the supervisor's snapshot requests. Nothing here
runs on the training thread but ``defer`` and the kernels' ``fresh.append``."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work

from moedoctor.layout import RunDir
from moedoctor.recorder.kernels import reduce_name
from moedoctor.recorder.records import annotation_line, done_line

if TYPE_CHECKING:
    from moedoctor.recorder.core import Recorder

MAX_PENDING = 4096  # collectives watched for completion; a backend whose works never report it
#                    (e.g. the fake backend) must not make each poll slower than the last


class Progress:
    def __init__(self, recorder: Recorder, poll_interval: float):
        self._recorder = recorder
        self.poll_interval = poll_interval
        #: (event, group, Work, ReduceOp, on CPU) appended by the kernels; the thread pops them.
        self.fresh: deque[tuple[int, int, object, object, bool]] = deque()
        #: (event, group, Work, its CPU future or None) not yet complete
        self._pending: deque[tuple[int, int, object, object]] = deque()
        self._last_done: dict[int, int] = {}  # group id -> latest event id seen complete
        self._deferred: deque[tuple[Callable, Callable]] = deque()  # evidence waiting on the GPU
        self._snapshot_seen = 0.0
        self._fr_poller: Any = None  # recorder/fr_poller.py's, once made; False where it is off or failed
        self._poll_lock = threading.Lock()  # the thread and the recorder's close() both poll
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        #: ``Recorder.pause()``: wake, do nothing, sleep again (what was waiting is done on resume).
        self.idle = False
        #: Wake-ups of the thread and the seconds they took (holding the GIL, mostly): benchmarks.
        self.wakes = 0
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0  # the thread's own CPU time in those wake-ups (GIL waits left out)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="moedoctor-progress", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """Stop the thread, then do its work one last time, waiting for every deferred value."""
        self._stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)
        self.check_native_writes()
        self._run_deferred(wait=True)
        self.poll_pending()
        self._poll_flight_recorder(final=True)

    def clear(self) -> None:
        """Recording stopped: forget what was waiting."""
        self.fresh.clear()
        self._pending.clear()
        self._deferred.clear()

    def defer(self, ready: Callable[[], bool], emit: Callable[[], None]) -> None:
        """Call ``emit`` from the thread once ``ready()`` is true (a GPU value has landed)."""
        self._deferred.append((ready, emit))

    # -- the thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        recorder = self._recorder
        snapshot_file = RunDir(recorder.run_dir).snapshot_request
        next_control = 0.0
        failures = 0
        while not self._stop.wait(self.poll_interval) and recorder.is_open:
            if self.idle:
                continue
            woke, woke_cpu = time.perf_counter(), time.thread_time()
            try:
                self.check_native_writes()
                self.poll_pending()
                self._run_deferred()
                self._poll_flight_recorder()
                now = time.monotonic()
                if now >= next_control:
                    next_control = now + 0.5
                    self._answer_snapshot(snapshot_file)
            except Exception as e:  # noqa: BLE001 - this thread must outlive any trouble of ours
                failures += 1
                if failures <= 3:
                    recorder.write_evidence("recorder_error", {"op": "progress thread", "error": repr(e)[:500]})
            self.wakes += 1
            self.busy_s += time.perf_counter() - woke
            self.busy_cpu_s += time.thread_time() - woke_cpu

    def _run_deferred(self, wait: bool = False) -> None:
        for _ in range(len(self._deferred)):
            ready, emit = self._deferred.popleft()
            try:
                if wait or ready():
                    emit()
                else:
                    self._deferred.append((ready, emit))
            except Exception:
                pass  # a value we could not read is evidence we do not have

    def check_native_writes(self) -> None:
        """[native seam] The C++ kernel stops writing on its first failed write and keeps the errno."""
        native = self._recorder._native
        if native is not None:
            number = native.write_error()
            if number:
                self._recorder.stop_recording(OSError(number, os.strerror(number)))

    def _poll_flight_recorder(self, final: bool = False) -> None:
        """Completion from PyTorch's Flight Recorder for the collectives whose ``Work`` is not
        watched (NCCL collectives without ``async_op``, functional collectives): about once a
        second, off the training thread (``moedoctor/recorder/fr_poller.py``)."""
        recorder = self._recorder
        poller = self._fr_poller
        if poller is None:
            if not recorder.is_open:
                return
            try:
                from moedoctor.recorder import fr_poller

                poller = self._fr_poller = fr_poller.FlightRecorderPoller(recorder) if fr_poller.enabled() else False
            except Exception as e:  # the traces suffice without it
                poller = self._fr_poller = False
                recorder.write_evidence("recorder_error", {"op": "flight recorder completion", "error": repr(e)})
        if not poller:
            return
        try:
            with self._poll_lock:
                poller.poll(final)
        except Exception as e:  # never again: a poller that failed once would fail every second
            self._fr_poller = False
            recorder.write_evidence("recorder_error", {"op": "flight recorder completion", "error": repr(e)})

    def poll_pending(self) -> None:
        recorder = self._recorder
        with self._poll_lock:
            if recorder._native is not None:  # [native seam] native works; Python ones left by a switch
                done = recorder._native.poll()
                if done:
                    recorder.records.write_locked(done_line(done))
            self._poll_pending_locked()

    def _poll_pending_locked(self) -> None:
        """Write which tracked collectives completed since the last poll, in one record.

        A work counts as complete when it says so, or, for a collective on CPU tensors, when its
        future does (the native kernel's rule: a CPU future completes when the backend has run the
        collective; a CUDA one, NCCL's, when it is enqueued), or when a later collective of its group
        has completed: one group's collectives run in issue order (some works, such as Gloo's
        emulated reduce-scatter, never report completion themselves).

        A c10d collective still running at its first poll also gets its reduce op resolved and
        written (``ReduceOp.op()`` is too slow for the hot path): these are the collectives a hang
        diagnosis looks at; ones that completed within a poll interval keep ``reduce_op`` null."""
        done: list[int] = []
        annotations: list[bytes] = []
        last_done = self._last_done
        # The kernels append on the right while this pops on the left; deque makes both thread-safe.
        for _ in range(len(self.fresh)):
            event_id, group_id, work, reduce_op, on_cpu = self.fresh.popleft()
            if isinstance(work, torch.ScriptObject):  # c10d ops hand back the TorchScript wrapper
                work = Work.unbox(work)
            future = self.cpu_future(work) if on_cpu else None
            if self.completed(work, future):
                done.append(event_id)
                last_done[group_id] = max(event_id, last_done.get(group_id, -1))
                continue
            if reduce_op is not None:
                annotations.append(annotation_line(event_id, reduce_name(reduce_op)))
            self._pending.append((event_id, group_id, work, future))
        still = []
        for _ in range(len(self._pending)):
            item = self._pending.popleft()
            if self.completed(item[2], item[3]):
                done.append(item[0])
                last_done[item[1]] = max(item[0], last_done.get(item[1], -1))
            else:
                still.append(item)
        for item in still:
            if item[0] < last_done.get(item[1], -1):
                done.append(item[0])
            else:
                self._pending.append(item)
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()  # the oldest: its completion stays unknown
        if done or annotations:
            if done:
                annotations.append(done_line(sorted(done)))
            self._recorder.records.write_locked(b"".join(annotations))

    @staticmethod
    def cpu_future(work):
        """The future of a CPU collective's Work, or None where it has none (Gloo's send/recv)."""
        try:
            return work.get_future()
        except Exception:
            return None

    @staticmethod
    def completed(work, future=None) -> bool:
        try:
            return (future is not None and future.done()) or work.is_completed()
        except Exception:  # a work that failed (its rank is going down): never completed
            return False

    def _answer_snapshot(self, snapshot_file: Path) -> None:
        try:
            requested = snapshot_file.stat().st_mtime
        except OSError:
            return
        if requested > self._snapshot_seen:
            self._snapshot_seen = requested
            self._recorder.write_coverage("snapshot")
            self._dump_flight_recorder()

    def _dump_flight_recorder(self) -> None:
        """Write PyTorch's own Flight Recorder buffer of this rank (on by default since torch 2.10)
        to ``RUN_DIR/flight_recorder/fr_rank_<rank>``, so a hang can also be read the way
        Flight Recorder tools read it, and compared."""
        recorder = self._recorder
        c10d = torch._C._distributed_c10d
        # NCCL keeps its own buffer; the generic one (Gloo's) is empty on an NCCL job.
        names = ("_dump_nccl_trace", "_dump_fr_trace") if dist.get_backend() == "nccl" else ("_dump_fr_trace",)
        dump = next((getattr(c10d, n) for n in names if hasattr(c10d, n)), None)
        if dump is None:
            return
        try:
            data = dump()
            folder = RunDir(recorder.run_dir).flight_recorder
            folder.mkdir(exist_ok=True)
            tmp = folder / f".fr_rank_{recorder._rank}.tmp"
            tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
            tmp.rename(folder / f"fr_rank_{recorder._rank}")
        except Exception as e:  # an old torch, or Flight Recorder disabled: the traces suffice
            recorder.write_evidence("recorder_error", {"op": "flight recorder dump", "error": repr(e)})
