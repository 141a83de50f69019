"""Read moedoctor trace files into the typed records of ``moedoctor.events``.

The reader rejects files of another format or an unknown version, and mixed versions across the
ranks of one run. A truncated or corrupt line (a rank killed mid-write) is reported as a problem of
that file, never raised.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.events import (
    CallSite,
    CheckpointedFunction,
    CollectiveEvent,
    Coverage,
    Evidence,
    Group,
    GroupCoverage,
    RankException,
    TraceHeader,
    TracebackFrame,
)
from moedoctor.trace import format as fmt
from moedoctor.trace import schema
from moedoctor.trace.schema import MAX_WORLD_SIZE


#: What a corrupt record line raises in ``TraceFile.parse_line``.
RECORD_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError)

#: Bounds on what a header may claim (the records' bounds are the schema's).
MAX_HEADER_BYTES = 64 << 10
#: A record line longer than this is skipped as corrupt without being parsed (a real one is < 10 KB).
MAX_RECORD_BYTES = 1 << 20


def short(value) -> str:
    """A value for a message, bounded: the repr of a small scalar, else only its type (never the
    repr of a container, which may be huge or, from a pickle's memo, exponentially large)."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return bounded_int(value)
    if isinstance(value, (str, bytes)):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    return f"a {type(value).__name__}"


def bounded_int(n: int) -> str:
    """An int for a message, bounded: never formats a number of thousands of digits."""
    return str(n) if -(1 << 64) < n < (1 << 64) else f"a {n.bit_length()}-bit number"


class TraceError(Exception):
    """A trace file or folder that cannot be read at all (wrong format, unknown or mixed versions)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """Collectives observed complete by one poll of the recorder (``DONE`` record)."""

    event_ids: tuple[int, ...]
    time: float
    source: str | None = None  # who proved it: None for the collective's Work, "fr" for Flight Recorder


@dataclass(frozen=True, slots=True)
class Annotation:
    """A detail of a collective written after it (``ANNOTATE`` record): its reduce op."""

    event_id: int
    reduce_op: str | None


@dataclass
class RankTrace:
    """Everything one rank's trace file holds, with completions folded into the events."""

    path: Path
    header: TraceHeader
    events: list[CollectiveEvent] = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)
    coverage: list[Coverage] = field(default_factory=list)
    #: Exceptions nothing caught in the rank (``EXCEPTION`` records), in file order.
    exceptions: list[RankException] = field(default_factory=list)
    groups: dict[str, Group] = field(default_factory=dict)
    capped: bool = False
    problems: list[str] = field(default_factory=list)
    #: Completions not observed through the collective's ``Work``: event id -> source
    #: (``moedoctor.trace.fr_completion``: "flight-recorder", "flight-recorder-dump").
    completed_by: dict[int, str] = field(default_factory=dict)
    #: Collectives Flight Recorder showed issued and not completed, and ones it could not tell
    #: (filled when the run directory holds Flight Recorder dumps: ``moedoctor.analysis.loading.completion``).
    fr_pending: set[int] = field(default_factory=set)
    fr_unknown: set[int] = field(default_factory=set)

    @property
    def rank(self) -> int:
        return self.header.rank


def read_header(path: Path) -> TraceHeader:
    with open(path, "rb") as f:
        first = f.readline(MAX_HEADER_BYTES + 1)
    if len(first) > MAX_HEADER_BYTES:
        raise TraceError(f"{path}: not a moedoctor trace (a first line over {MAX_HEADER_BYTES} bytes)")
    try:
        raw = json.loads(first)
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{path}: not a moedoctor trace (unreadable header: {str(e)[:120]})") from None
    if not isinstance(raw, dict) or raw.get("format") != fmt.FORMAT_NAME:
        raise TraceError(
            f"{path}: not a moedoctor trace (format {short(raw.get('format'))})"
            if isinstance(raw, dict)
            else f"{path}: not a moedoctor trace"
        )
    if raw.get("version") != fmt.FORMAT_VERSION:
        raise TraceError(
            f"{path}: trace format version {short(raw.get('version'))} is not supported "
            f"(this moedoctor reads version {fmt.FORMAT_VERSION})"
        )
    try:
        header = TraceHeader(
            format=raw["format"],
            version=raw["version"],
            rank=int(raw["rank"]),
            local_rank=int(raw["local_rank"]),
            world_size=int(raw["world_size"]),
            host=str(raw["host"]),
            pid=int(raw["pid"]),
            torch_version=str(raw["torch"]),
            moedoctor_version=str(raw["moedoctor"]),
            start_time=float(raw["start_time"]),
            kernel=schema.HEADER.key("kernel").type.decode(raw["kernel"]) if "kernel" in raw else None,
        )
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise TraceError(f"{path}: malformed header ({type(e).__name__}: {str(e)[:120]})") from None
    if not 0 < header.world_size <= MAX_WORLD_SIZE:
        raise TraceError(
            f"{path}: malformed header (world size {bounded_int(header.world_size)} outside 1..{MAX_WORLD_SIZE})"
        )
    if not 0 <= header.rank < header.world_size:
        raise TraceError(
            f"{path}: malformed header (rank {bounded_int(header.rank)} outside the world size {header.world_size})"
        )
    return header


class TraceFile:
    """One rank's trace, streamed: iterate to get ``CollectiveEvent``, ``Completion``, ``Annotation``,
    ``Evidence``, ``Coverage`` and ``RankException`` records in file order. ``problems`` fills as lines
    fail to parse."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.header = read_header(self.path)
        self.problems: list[str] = []
        with open(self.path, "rb") as f:
            if not f.readline(MAX_HEADER_BYTES + 1).endswith(b"\n"):
                self.problems.append(f"{self.path.name}: truncated after its header (no record)")
        self.capped = False
        self.groups: dict[int, Group] = {}
        self._sites: dict[int, CallSite] = {}

    def __iter__(self) -> Iterator[CollectiveEvent | Completion | Annotation | Evidence | Coverage | RankException]:
        with open(self.path, "rb") as f:
            f.readline()
            for lineno, line in enumerate(f, start=2):
                if not line.endswith(b"\n"):
                    self.problems.append(f"{self.path.name}: last record truncated (line {lineno})")
                    return
                try:
                    item = self.parse_line(line)
                except RECORD_ERRORS as e:
                    self.problems.append(f"{self.path.name}: corrupt record at line {lineno} ({e!r})")
                    continue
                if item is not None:
                    yield item

    def parse_line(self, line: bytes):
        """One record line of this file as a typed record, or None for a definition (group, call
        site, cap) that only updates this reader's state. Raises one of ``RECORD_ERRORS``.

        For readers that follow a growing file (the watchdog): lines must come in file order."""
        if len(line) > MAX_RECORD_BYTES:
            raise ValueError(f"a record of {len(line)} bytes (over {MAX_RECORD_BYTES})")
        return self._parse(json.loads(line), self.header.rank)

    def _parse(self, rec: dict, rank: int):
        kind = rec["k"]
        if kind == fmt.COLLECTIVE:
            return schema.decode_collective(rec, rank, self.groups, self._sites)
        if kind == fmt.DONE:
            v = schema.decode(schema.DONE, rec)
            return Completion(v["event_ids"], v["time"], v.get("source"))
        if kind == fmt.ANNOTATE:
            v = schema.decode(schema.ANNOTATE, rec)
            return Annotation(v["event_id"], v["reduce_op"])
        if kind == fmt.GROUP:
            v = schema.decode(schema.GROUP, rec)
            self.groups[v["id"]] = Group(v["name"], v.get("desc", ""), tuple(v["ranks"]))
        elif kind == fmt.SITE:
            v = schema.decode(schema.SITE, rec)
            self._sites[v["id"]] = CallSite(v["file"], v["line"], v["function"], v.get("stack", ()))
        elif kind == fmt.EVIDENCE:
            v = schema.decode(schema.EVIDENCE, rec)
            return Evidence(rank, v["time"], v["kind"], v["step"], v.get("data", {}))
        elif kind == fmt.COVERAGE:
            v = schema.decode(schema.COVERAGE, rec)
            groups = tuple(GroupCoverage(name, recorded, backend) for name, recorded, backend in v["groups"])
            return Coverage(rank, v["time"], v["reason"], groups, v.get("dropped", 0), v.get("kernel"))
        elif kind == fmt.EXCEPTION:
            return decode_exception(rec, rank)
        elif kind == fmt.CAP:
            self.capped = True
        return None


def fold(trace: RankTrace, index: dict[int, int], item: object) -> None:
    """Add one parsed record to ``trace``: a collective is appended (``index``: event id -> position),
    a completion or a reduce-op annotation is folded into the collective it names, evidence and
    coverage are appended. The one place records become a ``RankTrace``.

    The events were made by this reader a moment ago and nobody else holds them yet: a field is
    filled in place (a ``dataclasses.replace`` per event costs the hot path of large traces)."""
    if isinstance(item, CollectiveEvent):
        index[item.event_id] = len(trace.events)
        trace.events.append(item)
    elif isinstance(item, Completion):
        for event_id in item.event_ids:
            pos = index.get(event_id)
            if pos is not None and trace.events[pos].completed is None:
                object.__setattr__(trace.events[pos], "completed", item.time)
                if item.source is not None:
                    trace.completed_by[event_id] = completion_source(item.source)
    elif isinstance(item, Annotation):
        pos = index.get(item.event_id)
        if pos is not None:
            object.__setattr__(trace.events[pos], "reduce_op", item.reduce_op)
    elif isinstance(item, Evidence):
        trace.evidence.append(item)
    elif isinstance(item, Coverage):
        trace.coverage.append(item)
    elif isinstance(item, RankException):
        trace.exceptions.append(item)


def decode_exception(rec: dict, rank: int) -> RankException:
    """An ``x`` record as a ``RankException``, every value type-checked."""
    v = schema.decode(schema.EXCEPTION, rec)
    ckpt = v.get("checkpointed")
    return RankException(
        rank=rank,
        time=v["time"],
        type=v["type"],
        message=v["message"],
        frames=tuple(TracebackFrame(*f) for f in v["frames"]),
        thread=v["thread"],
        phase=v["phase"],
        step=v["step"],
        frames_left_out=v.get("frames_left_out", 0),
        checkpointed=None if ckpt is None else CheckpointedFunction(*ckpt),
    )


def read_trace(path: Path | str) -> RankTrace:
    """Load one rank's whole trace, completions folded into their events."""
    tf = TraceFile(path)
    trace = RankTrace(path=tf.path, header=tf.header)
    index: dict[int, int] = {}
    for item in tf:
        fold(trace, index, item)
    trace.groups = {g.name: g for g in tf.groups.values()}
    trace.capped = tf.capped
    trace.problems = tf.problems
    return trace


def completion_source(src) -> str:
    """The analysis's name for a ``d`` record's ``src`` (``"fr"``: the recorder read Flight Recorder)."""
    return "flight-recorder" if src == "fr" else f"other ({str(src)[:20]})"


def trace_paths(folder: Path | str) -> list[Path]:
    return sorted(Path(folder).glob("rank-*.jsonl"))


def read_traces(folder: Path | str) -> list[RankTrace]:
    """Every rank's trace in a folder, ordered by rank. Refuses mixed format versions."""
    traces = [read_trace(p) for p in trace_paths(folder)]
    versions = {(t.header.format, t.header.version) for t in traces}
    if len(versions) > 1:
        raise TraceError(f"{folder}: traces of mixed format versions {sorted(versions)}")
    return sorted(traces, key=lambda t: t.rank)
