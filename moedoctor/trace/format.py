"""Encoding of moedoctor trace files, version 1 (documented in ``docs/trace-format.md``).

A trace file is JSON Lines, one file per rank, append-only. The first line is the header; every
later line is one record whose ``k`` key says its kind. Groups and call sites are interned: defined
once by a ``g`` / ``s`` record, then referred to by a small integer, so a collective record stays short.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from moedoctor.errors import errno_text

from moedoctor.trace import schema
from moedoctor.trace.schema import FORMAT_NAME, FORMAT_VERSION

__all__ = ["FORMAT_NAME", "FORMAT_VERSION"]

#: Record kinds (their keys: ``moedoctor.trace.schema``).
GROUP = schema.GROUP.kind
SITE = schema.SITE.kind
COLLECTIVE = schema.COLLECTIVE.kind
DONE = schema.DONE.kind
ANNOTATE = schema.ANNOTATE.kind
EVIDENCE = schema.EVIDENCE.kind
COVERAGE = schema.COVERAGE.kind
CAP = schema.CAP.kind
EXCEPTION = schema.EXCEPTION.kind

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


# Recorder status: ``traces/rank-NNNNN.status``, one per rank, beside its trace. The recorder writes
# it when it opens the trace (state ``recording``) and rewrites it in place, at the same length, when
# a write of its own fails and it stops recording (state ``stopped``): the bytes are reserved while
# there is room, so the rewrite needs no new space on a full disk or over a quota. The supervisor
# reads it to say so and to take the silence of that trace for what it is, not for a hang.
STATUS_FORMAT = "moedoctor-recorder-status"
STATUS_BYTES = 1024
RECORDING = "recording"
STOPPED = "stopped"
_STATUS_SUFFIX = ".status"
_MAX_ERROR = 400


def status_file_name(rank: int) -> str:
    return f"rank-{rank:05d}{_STATUS_SUFFIX}"


def encode_status(rank: int, pid: int, state: str, **fields) -> bytes:
    """A status record as exactly ``STATUS_BYTES`` bytes: compact JSON padded with spaces, then
    ``\\n`` (string fields are cut to fit)."""
    record = {
        "format": STATUS_FORMAT,
        "version": FORMAT_VERSION,
        "rank": rank,
        "pid": pid,
        "state": state,
        **{k: v[:_MAX_ERROR] if isinstance(v, str) else v for k, v in fields.items()},
    }
    data = _dumps(record).encode()
    if len(data) > STATUS_BYTES - 1:
        record = {k: v for k, v in record.items() if not isinstance(v, str) or k in ("format", "state")}
        data = _dumps(record).encode()[: STATUS_BYTES - 1]
    return data.ljust(STATUS_BYTES - 1) + b"\n"


def reserve_status(traces: Path, rank: int, pid: int) -> int:
    """Create this rank's status file in state ``recording``; its descriptor, for ``stop_status``.
    OSError when it cannot be written."""
    path = traces / status_file_name(rank)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _pwrite_all(fd, encode_status(rank, pid, RECORDING, t=time.time()))
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()  # no half-written status: the failure goes to stderr instead
        raise
    return fd


def stop_status(fd: int, rank: int, pid: int, error: OSError, file: str, events: int) -> None:
    """Rewrite the status in place: recording stopped on ``error`` while writing ``file``, after
    ``events`` collectives. OSError when even that fails."""
    _pwrite_all(
        fd,
        encode_status(
            rank,
            pid,
            STOPPED,
            t=time.time(),
            errno=error.errno,
            error=error.strerror or str(error),
            file=file,
            events=events,
        ),
    )


def _pwrite_all(fd: int, data: bytes) -> None:
    offset = 0
    while offset < len(data):
        offset += os.pwrite(fd, data[offset:], offset)


def stopped_line(status: dict, then: str = "the job goes on, unrecorded") -> str:
    """``rank 1 stopped recording: No space left on device (errno 28 ENOSPC writing rank-00001.jsonl,
    after 412 collectives; the job goes on, unrecorded)``, from a ``stopped`` status."""
    detail = errno_text(status.get("errno"))
    file = status.get("file")
    if isinstance(file, str) and file:
        detail += f" writing {file}"
    events = status.get("events")
    if isinstance(events, int) and not isinstance(events, bool):
        detail += f", after {events} collective{'s' if events != 1 else ''}"
    error = status.get("error")
    error = error if isinstance(error, str) and error else "write failed"
    return f"rank {status.get('rank')} stopped recording: {error} ({detail}; {then})"


def read_statuses(traces: Path) -> dict[int, dict]:
    """The ranks' status records in ``traces`` (rank -> record); a file that is not one (damaged,
    foreign, caught mid-rewrite) is left out. Each read is bounded by ``STATUS_BYTES``."""
    found: dict[int, dict] = {}
    try:
        paths = sorted(Path(traces).glob("rank-*" + _STATUS_SUFFIX))
    except OSError:
        return found
    for path in paths:
        status = read_status(path)
        if status is not None:
            found[status["rank"]] = status
    return found


def read_status(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            data = f.read(STATUS_BYTES + 1)
    except OSError:
        return None
    if len(data) > STATUS_BYTES:
        return None
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("format") != STATUS_FORMAT:
        return None
    rank = record.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < (1 << 20):
        return None
    if record.get("state") not in (RECORDING, STOPPED) or path.name != status_file_name(rank):
        return None
    return record
