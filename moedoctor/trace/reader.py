"""Read moedoctor trace files into the typed records of ``moedoctor.events``.

The reader rejects files of another format or an unknown version, and mixed versions across the
ranks of one run. A truncated or corrupt line (a rank killed mid-write) is reported as a problem of
that file, never raised.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from moedoctor.events import (
    CallSite, CollectiveEvent, Coverage, Evidence, Group, GroupCoverage, Phase, TraceHeader,
)
from moedoctor.trace import format as fmt


#: What a corrupt record line raises in ``TraceFile.parse_line``.
RECORD_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError)


class TraceError(Exception):
    """A trace file or folder that cannot be read at all (wrong format, unknown or mixed versions)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """Collectives observed complete by one poll of the recorder (``DONE`` record)."""

    event_ids: tuple[int, ...]
    time: float
    source: str | None = None   # who proved it: None for the collective's Work, "fr" for Flight Recorder


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
    groups: dict[str, Group] = field(default_factory=dict)
    capped: bool = False
    problems: list[str] = field(default_factory=list)
    #: Completions not observed through the collective's ``Work``: event id -> source
    #: (``moedoctor.trace.fr_completion``: "flight-recorder", "flight-recorder-dump").
    completed_by: dict[int, str] = field(default_factory=dict)
    #: Collectives Flight Recorder showed issued and not completed, and ones it could not tell
    #: (filled when the run directory holds Flight Recorder dumps: ``moedoctor.analysis.completion``).
    fr_pending: set[int] = field(default_factory=set)
    fr_unknown: set[int] = field(default_factory=set)

    @property
    def rank(self) -> int:
        return self.header.rank


def read_header(path: Path) -> TraceHeader:
    with open(path, "rb") as f:
        first = f.readline()
    try:
        raw = json.loads(first)
    except ValueError as e:
        raise TraceError(f"{path}: not a moedoctor trace (unreadable header: {e})") from None
    if not isinstance(raw, dict) or raw.get("format") != fmt.FORMAT_NAME:
        raise TraceError(f"{path}: not a moedoctor trace (format {raw.get('format')!r})"
                         if isinstance(raw, dict) else f"{path}: not a moedoctor trace")
    if raw.get("version") != fmt.FORMAT_VERSION:
        raise TraceError(f"{path}: trace format version {raw.get('version')!r} is not supported "
                         f"(this moedoctor reads version {fmt.FORMAT_VERSION})")
    try:
        return TraceHeader(
            format=raw["format"], version=raw["version"], rank=int(raw["rank"]),
            local_rank=int(raw["local_rank"]), world_size=int(raw["world_size"]), host=str(raw["host"]),
            pid=int(raw["pid"]), torch_version=str(raw["torch"]), moedoctor_version=str(raw["moedoctor"]),
            start_time=float(raw["start_time"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: malformed header ({e!r})") from None


class TraceFile:
    """One rank's trace, streamed: iterate to get ``CollectiveEvent``, ``Completion``,
    ``Annotation``, ``Evidence`` and ``Coverage`` records in file order. ``problems`` fills as lines fail to parse."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.header = read_header(self.path)
        self.problems: list[str] = []
        with open(self.path, "rb") as f:
            if not f.readline().endswith(b"\n"):
                self.problems.append(f"{self.path.name}: truncated after its header (no record)")
        self.capped = False
        self.groups: dict[int, Group] = {}
        self._sites: dict[int, CallSite] = {}

    def __iter__(self) -> Iterator[CollectiveEvent | Completion | Annotation | Evidence | Coverage]:
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
        return self._parse(json.loads(line), self.header.rank)

    def _parse(self, rec: dict, rank: int):
        kind = rec["k"]
        if kind == fmt.COLLECTIVE:
            site = rec.get("s")
            return CollectiveEvent(
                rank=rank, event_id=rec["i"], time=rec["t"], group=self.groups[rec["g"]],
                seq=rec["seq"], op=rec["op"], raw_op=rec["raw"],
                in_shapes=tuple(tuple(s) for s in rec["in"]),
                out_shapes=tuple(tuple(s) for s in rec["out"]),
                dtypes=tuple(rec["dt"]), reduce_op=rec.get("red"), async_op=bool(rec["async"]),
                thread=rec["th"], call_site=None if site is None else self._sites[site],
                phase=Phase(rec["ph"]), step=rec["step"], module=rec.get("mod"),
                peer=rec.get("peer"), p2p_seq=rec.get("pseq"), root=rec.get("root"),
                in_splits=None if "sp" not in rec else tuple(rec["sp"][0]),
                out_splits=None if "sp" not in rec else tuple(rec["sp"][1]),
            )
        if kind == fmt.DONE:
            ids = rec["i"]
            return Completion(tuple(ids) if isinstance(ids, list) else (ids,), rec["t"], rec.get("src"))
        if kind == fmt.ANNOTATE:
            return Annotation(rec["i"], rec.get("red"))
        if kind == fmt.GROUP:
            self.groups[rec["id"]] = Group(rec["name"], rec.get("desc", ""), tuple(rec["ranks"]))
        elif kind == fmt.SITE:
            self._sites[rec["id"]] = CallSite(rec["file"], rec["line"], rec["fn"], tuple(rec.get("stack", ())))
        elif kind == fmt.EVIDENCE:
            return Evidence(rank, rec["t"], rec["kind"], rec["step"], rec.get("data", {}))
        elif kind == fmt.COVERAGE:
            groups = tuple(GroupCoverage(name, recorded, backend) for name, recorded, backend in rec["groups"])
            return Coverage(rank, rec["t"], rec["reason"], groups, rec.get("dropped", 0))
        elif kind == fmt.CAP:
            self.capped = True
        return None


def read_trace(path: Path | str) -> RankTrace:
    """Load one rank's whole trace, completions folded into their events."""
    tf = TraceFile(path)
    trace = RankTrace(path=tf.path, header=tf.header)
    index: dict[int, int] = {}
    for item in tf:
        if isinstance(item, CollectiveEvent):
            index[item.event_id] = len(trace.events)
            trace.events.append(item)
        elif isinstance(item, Completion):
            for event_id in item.event_ids:
                pos = index.get(event_id)
                if pos is not None and trace.events[pos].completed is None:
                    trace.events[pos] = replace(trace.events[pos], completed=item.time)
                    if item.source is not None:
                        trace.completed_by[event_id] = completion_source(item.source)
        elif isinstance(item, Annotation):
            pos = index.get(item.event_id)
            if pos is not None:
                trace.events[pos] = replace(trace.events[pos], reduce_op=item.reduce_op)
        elif isinstance(item, Evidence):
            trace.evidence.append(item)
        else:
            trace.coverage.append(item)
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
