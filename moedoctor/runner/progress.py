"""Follow the per-rank trace files of a running job, incrementally, for the watchdog and the live
status: per rank the last collective, its phase and step, and when the rank last made progress.

Progress is a collective issued or observed complete (a ``c`` or ``d`` record), seen as the file
grows; evidence and coverage records are not progress. Times are the watchdog's own monotonic clock
at the moment it read the record, so the clocks of other nodes do not matter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.analysis.evidence.timing import StormWatch
from moedoctor.events import CollectiveEvent, Coverage
from moedoctor.trace.format import STOPPED, read_status, stopped_line
from moedoctor.trace.reader import RECORD_ERRORS, Completion, TraceError, TraceFile, trace_paths


#: Incomplete collectives whose group is remembered per rank (the oldest are forgotten).
_OPEN_KEPT = 4096


@dataclass
class RankProgress:
    """What one rank's trace says so far."""

    rank: int
    host: str
    pid: int
    local_rank: int
    world_size: int
    last_progress: float
    issued: int = 0
    last: CollectiveEvent | None = None
    last_completed: bool = False
    coverage: Coverage | None = None
    capped: bool = False
    problems: list[str] = field(default_factory=list)
    #: The run of one op and call site going on now ("slow, not stuck" in the status line).
    storm: StormWatch = field(default_factory=StormWatch)
    #: Groups in which a collective was seen completing: there the recorder observes completions,
    #: so an incomplete collective of the group is really pending (``rank_states``).
    completed_groups: set[str] = field(default_factory=set)
    #: The group of each collective issued and not seen completing yet (the most recent ones).
    open_groups: dict[int, str] = field(default_factory=dict)

    @property
    def pending_tracked(self) -> bool:
        """The last collective did not complete, and completions of its group are observed."""
        last = self.last
        return (
            last is not None
            and not self.last_completed
            and not last.raw_op.startswith("_c10d_functional")
            and last.group.name in self.completed_groups
        )


class _Follower:
    """Reads the records appended to one trace file since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self.trace: TraceFile | None = None
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if self.trace is not None and size < self.offset:  # rewritten by a restarted rank
            self.trace, self.offset, self.partial = None, 0, b""
        if self.trace is None and not self._open():
            return []
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()  # an incomplete last line waits for the rest
        items = []
        for line in lines:
            try:
                item = self.trace.parse_line(line)
            except RECORD_ERRORS as e:
                self.trace.problems.append(f"{self.path.name}: corrupt record ({e!r})")
                continue
            if item is not None:
                items.append(item)
        return items

    def _open(self) -> bool:
        with open(self.path, "rb") as f:
            first = f.readline()
        if not first.endswith(b"\n"):
            return False  # the header is being written
        self.trace = TraceFile(self.path)
        self.offset = len(first)
        return True


class ProgressTracker:
    """Polled by the watchdog: ``poll()`` reads what every trace file gained and returns the
    per-rank state. Files that are not moedoctor traces are reported in ``problems``, once."""

    def __init__(
        self,
        traces_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        listener: Callable[[int, list, bool], None] | None = None,
    ):
        self.traces_dir = Path(traces_dir)
        self.clock = clock
        #: Called with (rank, newly read items, restarted) for every batch, so other consumers
        #: (the online desync detector) see each record parsed once, in file order.
        self.listener = listener
        self.ranks: dict[int, RankProgress] = {}
        self.problems: list[str] = []
        #: Ranks whose recorder stopped recording (a write of its own failed), with its line
        #: (``rank 1 stopped recording: No space left on device (...)``), from their status files.
        self.stopped: dict[int, str] = {}
        self._status_stamps: dict[Path, tuple[int, int]] = {}
        self._followers: dict[Path, _Follower] = {}
        self._rejected: set[Path] = set()

    def poll(self) -> dict[int, RankProgress]:
        now = self.clock()
        for path in trace_paths(self.traces_dir) if self.traces_dir.is_dir() else ():
            if path in self._rejected:
                continue
            follower = self._followers.setdefault(path, _Follower(path))
            try:
                items = follower.read_new()
            except TraceError as e:
                self._rejected.add(path)
                self.problems.append(str(e))
                continue
            if follower.trace is not None:
                self._apply(follower.trace, items, now)
        self._poll_statuses()
        return self.ranks

    def _poll_statuses(self) -> None:
        """Read the status files that changed since the last poll (``trace/format.py``)."""
        try:
            paths = list(self.traces_dir.glob("rank-*.status"))
        except OSError:
            return
        for path in paths:
            try:
                st = path.stat()
            except OSError:
                continue
            stamp = (st.st_mtime_ns, st.st_size)
            if self._status_stamps.get(path) == stamp:
                continue
            status = read_status(path)
            if status is None:
                continue  # caught mid-rewrite, or not a status: read again at the next poll
            self._status_stamps[path] = stamp
            if status["state"] == STOPPED:
                self.stopped.setdefault(status["rank"], stopped_line(status))
            else:
                self.stopped.pop(status["rank"], None)  # a restarted rank records again

    def _apply(self, trace: TraceFile, items: list, now: float) -> None:
        h = trace.header
        state = self.ranks.get(h.rank)
        restarted = state is not None and state.pid != h.pid
        if state is None or restarted:  # new, or restarted with a new process
            state = self.ranks[h.rank] = RankProgress(h.rank, h.host, h.pid, h.local_rank, h.world_size, now)
        if self.listener is not None and (items or restarted):
            self.listener(h.rank, items, restarted)
        for item in items:
            if isinstance(item, CollectiveEvent):
                state.issued += 1
                state.last, state.last_completed, state.last_progress = item, False, now
                state.storm.feed(item)
                state.open_groups[item.event_id] = item.group.name
                if len(state.open_groups) > _OPEN_KEPT:
                    del state.open_groups[next(iter(state.open_groups))]
            elif isinstance(item, Completion):
                state.last_progress = now
                for event_id in item.event_ids:
                    group = state.open_groups.pop(event_id, None)
                    if group is not None:
                        state.completed_groups.add(group)
                if state.last is not None and state.last.event_id in item.event_ids:
                    state.last_completed = True
            elif isinstance(item, Coverage):
                state.coverage = item
        state.capped = trace.capped
        state.problems = trace.problems

    def last_progress(self) -> float | None:
        """When any rank last made progress (None before any rank opened its trace)."""
        return max((r.last_progress for r in self.ranks.values()), default=None)

    def world_size(self) -> int | None:
        return max((r.world_size for r in self.ranks.values()), default=None)
