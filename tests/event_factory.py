"""Build typed trace records for analysis tests, and write them as real trace files.

    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_gather", (16,), phase=Phase.FORWARD, step=step, module="0")
    a.coll("all_reduce", (), phase=Phase.OPTIMIZER, step=3, done=False)
    run = run_of(a, b, hang=True)
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from moedoctor.analysis.loading.run_data import GpuSnapshot, ManifestInfo, RunData
from moedoctor.analysis.loading.load import last_sequences
from moedoctor.events import (
    CallSite, CheckpointedFunction, CollectiveEvent, Coverage, Evidence, Group, Phase, RankException, TraceHeader,
    TracebackFrame,
)
from moedoctor.runner.manifest import HangRecord, RankExit
from moedoctor.runner.procs import ProcessState
from moedoctor.runner.stacks import Frame, StackDump
from moedoctor.trace import schema
from moedoctor.trace.reader import RankTrace

WORLD = Group("0", "default_pg", (0, 1))


def world(n: int) -> Group:
    return Group("0", "default_pg", tuple(range(n)))


def site(line: int = 10, file: str = "/job/train.py", function: str = "main") -> CallSite:
    return CallSite(file, line, function, (f"{file}:{line} {function}",))


class TraceBuilder:
    """One rank's trace, built collective by collective. Times advance 1 ms per record."""

    def __init__(self, rank: int, world_size: int = 2, start: float = 1000.0):
        self.rank = rank
        self.world_size = world_size
        self.events: list[CollectiveEvent] = []
        self.evidence: list[Evidence] = []
        self.coverage: list[Coverage] = []
        self.exceptions: list[RankException] = []
        self.time = start
        self._seq: dict[str, int] = defaultdict(int)
        self._pseq: dict[tuple[str, int], int] = defaultdict(int)

    def _tick(self) -> float:
        self.time += 0.001
        return self.time

    def coll(self, op: str = "all_reduce", shape: tuple = (4,), *, dtype: str = "float32", group: Group | None = None,
             phase: Phase = Phase.OTHER, step: int = 0, line: int = 10, file: str = "/job/train.py",
             function: str = "main", module: str | None = None, reduce_op: str | None = None, done: bool = True,
             shapes: tuple | None = None, raw: str | None = None, out_shapes: tuple | None = None,
             root: int | None = None, splits: tuple[tuple, tuple] | None = None) -> TraceBuilder:
        """``shapes`` / ``out_shapes``: every input / output tensor's shape (default: ``shape`` both);
        ``splits``: all_to_all_single's (input, output) split sizes."""
        group = group or world(self.world_size)
        self._seq[group.name] += 1
        t = self._tick()
        in_shapes = shapes if shapes is not None else (tuple(shape),)
        self.events.append(CollectiveEvent(
            rank=self.rank, event_id=len(self.events), time=t, group=group, seq=self._seq[group.name], op=op,
            raw_op=raw or f"c10d::{op}_", in_shapes=in_shapes,
            out_shapes=in_shapes if out_shapes is None else out_shapes, dtypes=(dtype,),
            reduce_op=reduce_op, async_op=False, thread="MainThread", call_site=site(line, file, function),
            phase=phase, step=step, module=module, completed=t + 0.0005 if done else None, root=root,
            in_splits=None if splits is None else tuple(splits[0]),
            out_splits=None if splits is None else tuple(splits[1])))
        return self

    def p2p(self, op: str, peer: int, shape: tuple = (4,), *, group: Group | None = None, done: bool = True,
            line: int = 20) -> TraceBuilder:
        group = group or world(self.world_size)
        self._pseq[(group.name, peer)] += 1
        t = self._tick()
        self.events.append(CollectiveEvent(
            rank=self.rank, event_id=len(self.events), time=t, group=group, seq=self._seq[group.name], op=op,
            raw_op=f"c10d::{op}", in_shapes=(tuple(shape),), out_shapes=(), dtypes=("float32",), reduce_op=None,
            async_op=False, thread="MainThread", call_site=site(line), phase=Phase.OTHER, step=0, peer=peer,
            p2p_seq=self._pseq[(group.name, peer)], completed=t + 0.0005 if done else None))
        return self

    def ev(self, kind: str, step: int = 0, **data) -> TraceBuilder:
        self.evidence.append(Evidence(self.rank, self._tick(), kind, step, data))
        return self

    def exc(self, type_: str, message: str, frames: tuple[tuple[str, int, str], ...], *,
            phase: Phase = Phase.BACKWARD, step: int = 0,
            checkpointed: CheckpointedFunction | None = None) -> TraceBuilder:
        """An uncaught exception (``x`` record); ``frames`` outermost first, as (file, line, function)."""
        self.exceptions.append(RankException(
            self.rank, self._tick(), type_, message, tuple(TracebackFrame(*f) for f in frames), "MainThread", phase,
            step, checkpointed=checkpointed))
        return self

    def trace(self) -> RankTrace:
        header = TraceHeader("moedoctor-trace", 1, self.rank, self.rank, self.world_size, "host", 100 + self.rank,
                             "2.13", "0.1.0", 1000.0)
        groups = {e.group.name: e.group for e in self.events}
        return RankTrace(path=Path(f"rank-{self.rank:05d}.jsonl"), header=header, events=list(self.events),
                         evidence=list(self.evidence), coverage=list(self.coverage), groups=groups,
                         exceptions=list(self.exceptions))


def ranks(n: int, **kw) -> list[TraceBuilder]:
    return [TraceBuilder(r, n, **kw) for r in range(n)]


def both(builders, *args, **kw) -> None:
    """The same collective on every builder."""
    for b in builders:
        b.coll(*args, **kw)


def stack(rank: int, *frames: tuple[str, str, int], error: str | None = None, state: str | None = None,
          wchan: str | None = None) -> StackDump:
    """``frames`` innermost first, as (function, file, line); ``state``: the readings of the
    process's /proc state (``"TTTT"``; one letter stands for four equal readings)."""
    main = tuple(Frame(fn, file, line) for fn, file, line in frames)
    process = None
    if state is not None:
        process = ProcessState(state * 4 if len(state) == 1 else state, wchan, 0.2)
    return StackDump(rank=rank, pid=100 + rank, error=error, main_thread=main,
                     threads={"MainThread": main} if main else {}, process=process)


def in_collective(rank: int, user_line: int = 10, state: str | None = None) -> StackDump:
    return stack(rank, ("all_reduce", "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 3252),
                 ("main", "/job/train.py", user_line), state=state)


def manifest(exits: dict[int, int | None] | None = None, hang: bool = True, source: str = "torchrun") -> ManifestInfo:
    exits = exits or {}
    hang_rec = (HangRecord(detected_at=2000.0, host="host", hang_timeout=8.0, idle_seconds=8.0, stopped=True)
                if hang else None)
    return ManifestInfo(
        status="hang" if hang else "finished", hang=hang_rec,
        exits={r: RankExit(r, "host", 100 + r, r, code, "stopped" if code is None else source)
               for r, code in exits.items()},
        world_size=None)


def run_of(*builders: TraceBuilder, stacks: list[StackDump] = (), manifest_info: ManifestInfo | None = None,
           gpus: list[GpuSnapshot] = (), hang: bool | None = None, path: str = "/runs/test") -> RunData:
    traces = [b.trace() for b in builders]
    if manifest_info is None and hang:
        manifest_info = manifest(hang=True)
    run = RunData(path=Path(path), kind="traces", traces=sorted(traces, key=lambda t: t.rank),
                  world_size=max((b.world_size for b in builders), default=None), stacks={s.rank: s for s in stacks},
                  gpus=list(gpus), manifest=manifest_info)
    run.last_seq, run.last_p2p = last_sequences(run.traces)
    return run


# ---- trace files --------------------------------------------------------------------------------

def encode_trace(builder: TraceBuilder) -> bytes:
    """The builder's records as a version-1 trace file (groups and sites interned, completions as
    ``d`` records after their collectives, reduce ops as ``a`` annotations)."""
    header = {"format": "moedoctor-trace", "version": 1, "rank": builder.rank, "local_rank": builder.rank,
              "world_size": builder.world_size, "host": "host", "pid": 100 + builder.rank, "torch": "2.13",
              "moedoctor": "0.1.0", "start_time": 1000.0}
    lines = [header]
    gids: dict[str, int] = {}
    sids: dict[tuple, int] = {}
    records = [(e.time, 0, e) for e in builder.events] + [(e.time, 1, e) for e in builder.evidence]
    for _, kind, item in sorted(records, key=lambda x: (x[0], x[1])):
        if kind == 1:
            lines.append({"k": "e", "t": item.time, "kind": item.kind, "step": item.step, "data": item.data})
            continue
        e = item
        if e.group.name not in gids:
            gids[e.group.name] = len(gids)
            lines.append({"k": "g", "id": gids[e.group.name], "name": e.group.name, "desc": e.group.desc,
                          "ranks": list(e.group.ranks)})
        key = (e.call_site.file, e.call_site.line, e.call_site.function)
        if key not in sids:
            sids[key] = len(sids)
            lines.append({"k": "s", "id": sids[key], "file": key[0], "line": key[1], "fn": key[2],
                          "stack": list(e.call_site.stack)})
        rec = schema.record_of(e, gids[e.group.name], sids[key])
        rec.pop("red", None)  # written as an annotation below, as the Python kernels do for c10d ops
        lines.append(rec)
        if e.reduce_op:
            lines.append({"k": "a", "i": e.event_id, "red": e.reduce_op})
        if e.completed is not None:
            lines.append({"k": "d", "t": e.completed, "i": [e.event_id]})
    return b"".join(json.dumps(x, separators=(",", ":")).encode() + b"\n" for x in lines)


def write_traces(folder: Path, *builders: TraceBuilder) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for b in builders:
        (folder / f"rank-{b.rank:05d}.jsonl").write_bytes(encode_trace(b))
    return folder
