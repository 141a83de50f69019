"""The JSON form of a ``Report``: a stable schema, documented in ``docs/report-format.md``.

``report.json`` in a run directory and ``moedoctor analyze --json`` write the same document.
"""

from __future__ import annotations

from dataclasses import asdict

import json
from pathlib import Path

import moedoctor
from moedoctor._files import write_atomically
from moedoctor.analysis.model import Divergence, OpView, Report, WaitEdge
from moedoctor.analysis.evidence.timing import SlowReport

#: Tensors per op shown in the report (a record may hold 4096): the rest are counted in ``shapes_total``.
MAX_SHAPES = 32
#: Above this size the report's long lists (groups, wait_for, ranks, incomplete, evidence) are cut
#: to ``CUT_TO`` entries each and ``"truncated": true`` is set, so that the report stays bounded.
MAX_REPORT_BYTES = 32 << 20
CUT_TO = 100
_CUT_KEYS = ("groups", "wait_for", "incomplete", "evidence", "candidates")


def report_to_dict(report: Report) -> dict:
    return {
        "schema_version": report.schema_version,
        "moedoctor_version": moedoctor.__version__,
        "source": {
            "path": report.source,
            "kind": report.source_kind,
            "world_size": report.world_size,
            "traced_ranks": report.traced_ranks,
            "collectives": report.collectives,
        },
        "verdict": report.verdict.value,
        "summary": report.summary,
        "mechanism": None if report.mechanism is None else report.mechanism.to_dict(),
        "pattern": report.pattern,
        "pattern_title": report.pattern_title,
        "not_named": report.not_named,
        "culprit_ranks": report.culprit_ranks,
        "culprit_reasoning": report.culprit_reasoning,
        "divergence": divergence_to_dict(report.divergence),
        "evidence": report.evidence,
        "fixes": report.fixes,
        "verify_command": report.verify_command,
        "fix_note": report.fix_note,
        "fix_config": report.fix_config,
        "suggestion": None
        if report.suggestion is None
        else {
            "call_site": report.suggestion.call_site,
            "function": report.suggestion.function,
            "source_line": report.suggestion.source_line,
            "text": report.suggestion.text,
        },
        "candidates": [
            {"pattern": c.pattern, "score": c.score, "evidence": list(c.evidence)} for c in report.candidates
        ],
        "wait_for": [_edge(e) for e in report.wait_for],
        "cycle": None if report.cycle is None else [_edge(e) for e in report.cycle],
        "groups": [divergence_to_dict(d) for d in report.groups],
        "ranks": {
            str(r.rank): {
                "last": op_to_dict(r.last),
                "group": r.group,
                "waiting": r.waiting,
                "stack": r.stack,
                "in_collective": r.in_collective,
                "exit_code": r.exit_code,
                "exit_source": r.exit_source,
                "process_state": r.process_state,
            }
            for r in report.ranks
        },
        "incomplete": report.incomplete,
        "completion": report.completion,
        "slow": slow_to_dict(report.slow),
        "busy": [asdict(b) for b in report.busy],
    }


def slow_to_dict(slow: SlowReport | None) -> dict | None:
    """The "Slow, not stuck" section (``moedoctor.analysis.evidence.timing``); None when no storm was found."""
    if slow is None:
        return None
    return {
        "pattern": "broadcast-storm",
        "summary": slow.summary(),
        "storms": [
            {
                "op": s.op,
                "group": s.group,
                "call_site": s.call_site,
                "function": s.function,
                "phase": s.phase,
                "steps": list(s.steps),
                "ranks": list(s.ranks),
                "first_seq": s.first_seq,
                "count": s.count,
                "seconds": round(s.seconds, 6),
                "bytes": s.bytes,
                "per_collective_s": round(s.per_collective_s, 9),
                "latency_bound": s.latency_bound,
                "coalesced_s": round(s.gain.coalesced_s, 6),
                "gain_s": round(s.gain.gain_s, 6),
                "estimate": s.gain.method,
                "estimate_weak": s.gain.weak,
            }
            for s in slow.storms
        ],
        "phases": [
            {
                "rank": p.rank,
                "phase": p.phase,
                "call_site": p.call_site,
                "op": p.op,
                "count": p.count,
                "seconds": round(p.seconds, 6),
                "bytes": p.bytes,
                "mean_interval_s": round(p.mean_interval_s, 9),
            }
            for p in slow.phases
        ],
    }


def op_to_dict(op: OpView | None) -> dict | None:
    if op is None:
        return None
    doc = {
        "seq": op.seq,
        "op": op.op,
        "shapes": [list(s) for s in op.shapes[:MAX_SHAPES]],
        "out_shapes": [list(s) for s in op.out_shapes[:MAX_SHAPES]],
        "dtypes": list(op.dtypes[:MAX_SHAPES]),
        "reduce_op": op.reduce_op,
        "call_site": op.call_site,
        "function": op.function,
        "phase": op.phase,
        "step": op.step,
        "module": op.module,
        "peer": op.peer,
        "completed": op.completed,
        "time": op.time,
    }
    if max(len(op.shapes), len(op.out_shapes), len(op.dtypes)) > MAX_SHAPES:
        doc["shapes_total"] = [len(op.shapes), len(op.out_shapes)]
    return doc


def divergence_to_dict(div: Divergence | None) -> dict | None:
    if div is None:
        return None
    return {
        "kind": div.kind.value,
        "group": {"name": div.group.name, "desc": div.group.desc, "ranks": list(div.group.ranks)},
        "seq": div.seq,
        "peers": list(div.peers) if div.peers else None,
        "per_rank": {str(r): op_to_dict(v) for r, v in div.per_rank.items()},
        "classes": [list(c) for c in div.classes],
        "missing": list(div.missing),
        "breaches": list(div.breaches),
    }


def _edge(e: WaitEdge) -> dict:
    return {"rank": e.rank, "group": e.group, "seq": e.seq, "op": e.op, "waits_for": list(e.waits_for)}


def dumps(report: Report, limit: int | None = None) -> str:
    """The report as JSON, at most about ``MAX_REPORT_BYTES``: beyond, its long lists are cut."""
    limit = MAX_REPORT_BYTES if limit is None else limit
    doc = report_to_dict(report)
    text = json.dumps(doc, indent=1, allow_nan=False, default=str)
    if len(text) <= limit:
        return text
    for key in _CUT_KEYS:
        if isinstance(doc.get(key), list):
            doc[key] = doc[key][:CUT_TO]
    if isinstance(doc.get("ranks"), dict) and len(doc["ranks"]) > CUT_TO:
        keep = set(map(str, report.culprit_ranks)) | set(list(doc["ranks"])[:CUT_TO])
        doc["ranks"] = {r: v for r, v in doc["ranks"].items() if r in keep}
    doc["truncated"] = True
    return json.dumps(doc, indent=1, allow_nan=False, default=str)


def write_json(report: Report, path: Path) -> Path:
    """Write atomically: a reader never sees half a report."""
    path = Path(path)
    write_atomically(path, dumps(report) + "\n")
    return path


#: The parameter check's section (``moedoctor run --check-params``; docs/report-format.md, ``params``).
PARAMS = "params"


def dumps_with_params(report: Report, params: dict | None) -> str:
    """``moedoctor analyze --json``'s document: the report, with the parameter check's section when
    there is one (then on one line)."""
    if params is None:
        return dumps(report)
    return json.dumps({**json.loads(dumps(report)), PARAMS: params})


def add_params(path: Path, params: dict) -> bool:
    """Add the parameter check's section to the ``report.json`` at ``path`` (written earlier by
    ``write_json``); False when there is no report there to add it to. OSError, ValueError as the
    file's reading and writing raise them."""
    path = Path(path)
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return False
    data[PARAMS] = params
    write_atomically(path, json.dumps(data, indent=1) + "\n")
    return True
