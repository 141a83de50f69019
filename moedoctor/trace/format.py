"""Encoding of moedoctor trace files, version 1 (documented in ``docs/trace-format.md``).

A trace file is JSON Lines, one file per rank, append-only. The first line is the header; every
later line is one record whose ``k`` key says its kind. Groups and call sites are interned: defined
once by a ``g`` / ``s`` record, then referred to by a small integer, so a collective record stays short.
"""

from __future__ import annotations

import json

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
