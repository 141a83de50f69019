"""Encoding of moedoctor trace files, version 1 (documented in ``docs/trace-format.md``).

A trace file is JSON Lines, one file per rank, append-only. The first line is the header; every
later line is one record whose ``k`` key says its kind. Groups and call sites are interned: defined
once by a ``g`` / ``s`` record, then referred to by a small integer, so a collective record stays short.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT_NAME = "moedoctor-trace"
FORMAT_VERSION = 1

#: Record kinds.
GROUP = "g"
SITE = "s"
COLLECTIVE = "c"
DONE = "d"
ANNOTATE = "a"
EVIDENCE = "e"
COVERAGE = "v"
CAP = "cap"

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str).encode


def encode(record: dict) -> bytes:
    """One record as a newline-terminated line of compact JSON."""
    return (_dumps(record) + "\n").encode()


def trace_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.jsonl"


# Install markers: each rank's recorder, once loaded (before any process group exists), leaves
# ``control/recorder-rank-N`` (its pid) in the run directory, so a run without traces can tell "the
# recorder never loaded" from "loaded, but no rank created its process group".
_MARKER_PREFIX = "recorder-rank-"


def write_recorder_marker(control: Path, rank: int, pid: int) -> None:
    control.mkdir(parents=True, exist_ok=True)
    (control / f"{_MARKER_PREFIX}{rank}").write_text(f"{pid}\n")


def recorder_markers(control: Path) -> dict[int, float]:
    """The ranks whose recorder left its install marker, with the time it did (mtime)."""
    found: dict[int, float] = {}
    try:
        entries = list(control.iterdir())
    except OSError:
        return found
    for entry in entries:
        suffix = entry.name.removeprefix(_MARKER_PREFIX)
        if suffix != entry.name and suffix.isdigit():
            try:
                found[int(suffix)] = entry.stat().st_mtime
            except OSError:
                continue
    return found
