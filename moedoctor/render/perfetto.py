"""A Chrome-trace / Perfetto JSON of the run: one process track per rank, one thread per process
group inside it, collectives as slices (issue to completion; still running ones to the end of the
trace), and the divergence marked with an instant event on each rank's track.

Open it at https://ui.perfetto.dev or chrome://tracing. Slices on one track are clipped so they
nest (an asynchronous collective that completes after the next one was issued ends where the next
begins; ``args.completed_at_us`` keeps the real time).
"""

from __future__ import annotations

import json
from pathlib import Path

from moedoctor.analysis.loading.run_data import RunData
from moedoctor.analysis.model import Report
from moedoctor.events import CollectiveEvent


def perfetto_trace(run: RunData, report: Report) -> dict:
    events = [e for t in run.traces for e in t.events]
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": _meta(report)}
    t0 = min(e.time for e in events)
    end = max(max(e.completed or e.time for e in events), max(e.time for e in events))
    if run.manifest is not None and run.manifest.hang is not None:
        end = max(end, run.manifest.hang.detected_at)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    out: list[dict] = []
    tids: dict[tuple[int, str], int] = {}
    for trace in run.traces:
        out.append({"ph": "M", "name": "process_name", "pid": trace.rank, "args": {"name": f"rank {trace.rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": trace.rank, "args": {"sort_index": trace.rank}})
        by_track: dict[int, list[CollectiveEvent]] = {}
        for e in trace.events:
            key = (trace.rank, e.group.name)
            if key not in tids:
                tids[key] = len([k for k in tids if k[0] == trace.rank]) + 1
                name = f"group {e.group.name}" + (f" ({e.group.desc})" if e.group.desc else "")
                out.append(
                    {"ph": "M", "name": "thread_name", "pid": trace.rank, "tid": tids[key], "args": {"name": name}}
                )
            by_track.setdefault(tids[key], []).append(e)
        for tid, track in by_track.items():
            track.sort(key=lambda e: (e.time, e.event_id))
            for i, e in enumerate(track):
                stop = e.completed if e.completed is not None else end
                if i + 1 < len(track):
                    stop = min(stop, track[i + 1].time)
                args = {
                    "seq": e.seq,
                    "shapes": [list(s) for s in e.in_shapes],
                    "dtypes": list(e.dtypes),
                    "reduce_op": e.reduce_op,
                    "phase": e.phase.value,
                    "step": e.step,
                    "module": e.module,
                    "call_site": None if e.call_site is None else e.call_site.where,
                    "completed": e.completed is not None,
                    "completed_at_us": None if e.completed is None else us(e.completed),
                }
                if e.is_p2p:
                    args.update(peer=e.peer, p2p_seq=e.p2p_seq)
                out.append(
                    {
                        "ph": "X",
                        "name": e.op + ("" if e.completed is not None else " (waiting)"),
                        "cat": "collective",
                        "pid": trace.rank,
                        "tid": tid,
                        "ts": us(e.time),
                        "dur": max(us(stop) - us(e.time), 1.0),
                        "args": args,
                    }
                )
    div = report.divergence
    if div is not None:
        label = f"DIVERGENCE {div.kind.value} at #{div.seq} of group {div.group.name}" + (
            f" ({report.pattern})" if report.pattern else ""
        )
        for rank, op in div.per_rank.items():
            tid = tids.get((rank, div.group.name), 1)
            ts = us(op.time) if op is not None else us(end)
            out.append(
                {
                    "ph": "i",
                    "s": "p",
                    "name": label,
                    "pid": rank,
                    "tid": tid,
                    "ts": ts,
                    "args": {
                        "rank": rank,
                        "culprit": rank in report.culprit_ranks,
                        "op": None if op is None else op.op,
                        "call_site": None if op is None else op.call_site,
                        "never_issued": op is None,
                    },
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": _meta(report)}


def _meta(report: Report) -> dict:
    return {
        "moedoctor_verdict": report.verdict.value,
        "pattern": report.pattern,
        "culprit_ranks": ",".join(map(str, report.culprit_ranks)),
        "summary": report.summary,
    }


def write_perfetto(run: RunData, report: Report, path: Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(perfetto_trace(run, report), separators=(",", ":")))
    return path
