"""Completion from PyTorch's Flight Recorder, for the collectives whose ``Work`` cannot be watched.

Called by the recorder's progress thread (never by the training thread). On NCCL a collective
issued without ``async_op`` hands the dispatcher no ``Work`` (torch >= 2.8), and functional
collectives are not watched on any backend: their completion would be missing from the trace. About
once a second, when such collectives are waiting, this reads the rank's own trace from where it
stopped (``moedoctor.trace.fr_completion.LiveTracker``), asks Flight Recorder for the entries still
active (``_dump_nccl_trace(includeStackTraces=False, onlyActive=True)``: about 1 ms on an H100 host
with a full ring buffer; the full dump costs about 30 ms there, holding the GIL, and is taken once a
minute at most, to learn a group's ``pg_id``) and writes one ``d`` record with ``"src":"fr"`` for the
collectives it proves complete (rules: ``LiveTracker.resolve_active``). On Gloo, whose entries
never leave ``scheduled``, the generic buffer (``_dump_fr_trace``) is read whole and its ``retired``
flags used, only while functional collectives wait. The interval grows to 1,000 times the last
poll's cost, so that the thread never takes more than about 0.1% of the GIL (100 times, the first
choice, was itself a whole 1% budget: 1.6% of a Gloo FSDP2 loop's time on a 2-core machine). No host-device sync:
Flight Recorder queries CUDA events, it never waits on them.

``MOEDOCTOR_FR_COMPLETION=0`` turns it off.
"""

from __future__ import annotations

import os
import pickle
import time

import torch
import torch.distributed as dist

from moedoctor import environment
from moedoctor.layout import RunDir
from moedoctor.recorder.records import done_line

from moedoctor.trace import format as fmt
from moedoctor.trace.flight_recorder import _last_completed
from moedoctor.trace.fr_completion import DONE_SOURCE_FR, LiveTracker, entries_from_dump

ENV_SWITCH = environment.FR_COMPLETION.name
INTERVAL = 1.0  # seconds between polls, at least
COST_FACTOR = 1000  # ... and at least this many times the last poll's duration
READ_CHUNK = 16 << 20  # bytes of the trace read per poll at most
TAIL_PER_ENTRY = 512  # bytes of the trace followed per ring-buffer entry; anything older is skipped
FULL_DUMP_EVERY = 60.0  # seconds between full dumps at most (to learn a group's pg_id)


def enabled() -> bool:
    return environment.fr_completion()


def ring_size() -> int:
    """Flight Recorder's ring buffer, in entries (torch reads the same variables; 2000 by default
    where it is on by default)."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                pass
    return 2000


class FlightRecorderPoller:
    """One per recorder, created by the progress thread once the trace is open."""

    def __init__(self, recorder) -> None:
        self._recorder = recorder
        self._path = RunDir(recorder.run_dir).traces / fmt.trace_file_name(recorder._rank)
        self._offset = len(_first_line(self._path))
        self._backends: dict[str, str] = {}
        self._groups: dict[str, object] = {}
        self.tracker = LiveTracker(self._wanted)
        self._settled = -1
        self._next = 0.0
        self._pg_ids: dict[str, str] = {}  # group name -> Flight Recorder's pg_id (learnt from entries)
        self._uids: dict[str, str] = {}  # group name -> ProcessGroupNCCL.uid (the same number, once confirmed)
        self._uid_confirmed = False  # some group's uid equalled its entries' pg_id, and none differed
        self._uid_wrong = False
        self._next_full = 0.0
        self.window = ring_size()
        c10d = torch._C._distributed_c10d
        self._dump_nccl = getattr(c10d, "_dump_nccl_trace", None)
        self._dump_generic = getattr(c10d, "_dump_fr_trace", None)
        self.off = self.window <= 0 or (self._dump_nccl is None and self._dump_generic is None)
        self.polls = 0
        self.claimed = 0
        self.last_cost = 0.0
        self.total_cost = 0.0

    # -- which collectives ----------------------------------------------------------------------

    def _backend(self, group: str) -> str:
        backend = self._backends.get(group)
        if backend is None:
            pg = self._recorder.process_group(group)
            try:
                backend = str(dist.get_backend(pg)) if pg is not None else ""
            except Exception:
                backend = ""
            self._backends[group] = backend
            self._groups[group] = pg
            if backend == "nccl":
                try:
                    self._uids[group] = str(int(pg._get_backend(torch.device("cuda")).uid))
                except Exception:
                    pass
        return backend

    def _wanted(self, group: str, raw: str) -> bool:
        backend = self._backend(group)
        if backend == "nccl":
            return True  # sync collectives hand the dispatcher no Work
        return raw.startswith("_c10d_functional") and "gloo" in backend

    # -- polling --------------------------------------------------------------------------------

    def poll(self, final: bool = False) -> None:
        """Read Flight Recorder if it is time (always when ``final``: the rank is closing)."""
        if self.off:
            return
        now = time.monotonic()
        if now < self._next and not final:
            return
        start = time.perf_counter()
        try:
            self._poll(final)
        finally:
            self.last_cost = time.perf_counter() - start
            self.total_cost += self.last_cost
            self._next = time.monotonic() + max(INTERVAL, COST_FACTOR * self.last_cost)
            self.polls += 1

    def _poll(self, final: bool) -> None:
        self._read_tail()
        tracker = self.tracker
        settled, self._settled = self._settled, tracker.last_event
        if final:
            settled = tracker.last_event
        if not tracker.has_pending() or (not tracker.pending and not final):
            return  # p2p ops alone are decided at the last poll (a full dump), not from onlyActive ones
        groups = tracker.pending_groups()
        nccl = [g for g in groups if self._backend(g) == "nccl"]
        other = [g for g in groups if g not in nccl]
        done: list[int] = []
        if nccl and self._dump_nccl is not None:
            tops = dict(tracker.top_seq)
            counts = {}
            for group in nccl:
                try:
                    counts[group] = int(self._groups[group]._get_sequence_number_for_group())  # type: ignore[attr-defined]
                except Exception:
                    continue
            # p2p ops (batch_isend_irecv's get null Works) are decided from a full dump: the last one
            # when the rank closes its groups, and any full dump taken anyway.
            full = self._needs_full_dump(nccl, settled) or (final and tracker.has_p2p_pending(nccl))
            raw, only_active = _dump(self._dump_nccl, only_active=not full)
            self._read_tail()
            self._learn_pg_ids(raw)
            entries = entries_from_dump(raw)
            if not only_active:  # every entry, with its state (also: an old torch without onlyActive)
                done += tracker.resolve_p2p(entries, nccl, launched=not final)
                done += tracker.resolve_states(entries, nccl, launched=not final)
                entries = [e for e in entries if e.done is None]  # what onlyActive lists
            status = _last_completed(raw.get("pg_status"))
            last_completed = {g: status[self._pg_id(g)] for g in nccl if self._pg_id(g) in status}
            done += tracker.resolve_active(entries, counts, tops, settled, self.window, final, last_completed)
        if other and self._dump_generic is not None:
            raw, _ = _dump(self._dump_generic, only_active=False)
            done += tracker.resolve_states(entries_from_dump(raw), other)
        if done:
            self.claimed += len(done)
            self._recorder.records.write_locked(done_line(sorted(done), source=DONE_SOURCE_FR))

    def _needs_full_dump(self, groups: list[str], settled: int) -> bool:
        """A full dump (about 30 ms on an H100 host, holding the GIL) once a minute at most, when a
        group's collectives have waited a poll already and its ``pg_id`` is unknown (it is learnt
        from entries: an ``onlyActive`` dump holds none of a group whose collectives all completed)."""
        now = time.monotonic()
        if now < self._next_full:
            return False
        for group in groups:
            if self._pg_id(group) is not None or group in self.tracker.p2p_groups:
                continue
            if any(p.event_id <= settled for p in self.tracker.pending.get(group, {}).values()):
                self._next_full = now + FULL_DUMP_EVERY
                return True
        return False

    def _learn_pg_ids(self, raw: dict) -> None:
        for entry in raw.get("entries") or ():
            try:
                group, pg_id = str(entry["process_group"][0]), str(int(entry["pg_id"]))
            except (KeyError, TypeError, ValueError, IndexError):
                continue
            self._pg_ids.setdefault(group, pg_id)
            uid = self._uids.get(group)
            if uid is not None:
                self._uid_confirmed |= uid == pg_id
                self._uid_wrong |= uid != pg_id

    def _pg_id(self, group: str) -> str | None:
        """Flight Recorder's ``pg_id`` of a group: seen in its entries, or its ``ProcessGroupNCCL.uid``
        (the same counter, ``local_id_``) once the entries of some group confirmed that and none denied it."""
        pg_id = self._pg_ids.get(group)
        if pg_id is None and self._uid_confirmed and not self._uid_wrong:
            pg_id = self._uids.get(group)
        return pg_id

    def _read_tail(self) -> None:
        """Feed the tracker what the trace gained since the last read (this process writes it).

        Only the last ``window * TAIL_PER_ENTRY`` bytes are followed: Flight Recorder proves nothing
        about older collectives but through a later one of their group, and parsing every record in
        Python (2-3 us each, holding the GIL) made a poll's cost grow with the backlog, and with it
        the next interval (1,000 times the cost): above about 400 collectives a second the tracker
        fell behind for good. What is skipped is only scanned for group records (``LiveTracker.skip``)."""
        try:
            with open(self._path, "rb") as f:
                backlog = os.fstat(f.fileno()).st_size - self._offset
                f.seek(self._offset)
                skip = backlog - max(self.window, 1) * TAIL_PER_ENTRY
                while skip > 0:
                    data = f.read(min(READ_CHUNK, skip))
                    if not data:
                        break
                    skip -= len(data)
                    self._offset += len(data)
                    self.tracker.skip(data)
                data = f.read(READ_CHUNK)
        except OSError:
            return
        self._offset += len(data)
        self.tracker.feed(data)


def _dump(function, only_active: bool) -> tuple[dict, bool]:
    """Flight Recorder's buffer without stack traces (symbolizing them is the costly part), unpickled.
    The bytes come from torch in this process."""
    try:
        data = function(includeCollectives=True, includeStackTraces=False, onlyActive=only_active)
    except TypeError:  # torch without these arguments
        data, only_active = function(), False
    raw = pickle.loads(data)
    return (raw if isinstance(raw, dict) else {}), only_active


def _first_line(path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.readline()
    except OSError:
        return b""
