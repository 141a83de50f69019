"""Record writing: every line of this rank's trace except the collective itself is made here, from the
schema's tables (``moedoctor.trace.schema.fields``: the keys in the table's order, by attribute name),
and written through the one ``TraceWriter``. ``TraceRecords`` also keeps what the records number: the
event ids, each group's id and sequence numbers, each call site's id, what was written and dropped.

Used by the Python kernels (``kernels.py``), the progress thread, the Flight Recorder poller, the
native kernel's Python side and the ``Recorder`` facade; imports none of them."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

import torch

import moedoctor
from moedoctor.recorder import callsite
from moedoctor.recorder.groups import GroupRanks, description
from moedoctor.recorder.writer import TraceWriter
from moedoctor.trace import format as fmt
from moedoctor.trace import schema

_json_strings: dict[str, str] = {}


def json_str(value: str) -> str:
    """``value`` as JSON text, remembered (thread names, module names, devices repeat)."""
    encoded = _json_strings.get(value)
    if encoded is None:
        encoded = _json_strings[value] = json.dumps(value)
    return encoded


def encode(record: dict) -> bytes:
    """A record made with ``schema.fields`` as one line."""
    return fmt.encode(record)


# -- the lines, each from its table ------------------------------------------------------------------


def header_line(rank: int, world_size: int, kernel: str) -> bytes:
    return fmt.encode(
        schema.fields(
            schema.HEADER,
            format=fmt.FORMAT_NAME,
            version=fmt.FORMAT_VERSION,
            rank=rank,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            world_size=world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            torch_version=torch.__version__,
            moedoctor_version=moedoctor.__version__,
            start_time=time.time(),
            kernel=kernel,
        )
    )


def group_fields(name: str, ranks: tuple[int, ...], **id_) -> dict:
    """A ``g`` record; without ``id`` only the keys after it (the C++ kernel writes the rest)."""
    after = None if id_ else "id"
    return schema.fields(schema.GROUP, after=after, name=name, desc=description(name), ranks=list(ranks), **id_)


def site_fields(key: tuple, **id_) -> dict:
    """An ``s`` record of call site ``key``; without ``id`` only the keys after it."""
    file, line, fn, stack = callsite.describe(key)
    after = None if id_ else "id"
    return schema.fields(schema.SITE, after=after, file=file, line=line, function=fn, stack=stack, **id_)


def cap_line(limit: int) -> bytes:
    return fmt.encode(schema.fields(schema.CAP, time=time.time(), limit=limit))


def done_line(event_ids: list[int] | int, source: str | None = None) -> bytes:
    return fmt.encode(schema.fields(schema.DONE, time=time.time(), event_ids=event_ids, source=source))


def annotation_line(event_id: int, reduce_op: str | None) -> bytes:
    return fmt.encode(schema.fields(schema.ANNOTATE, event_id=event_id, reduce_op=reduce_op))


def evidence_line(kind: str, step: int, data: dict | None) -> bytes:
    return fmt.encode(schema.fields(schema.EVIDENCE, time=time.time(), kind=kind, step=step, data=data or None))


def coverage_line(reason: str, groups: list, dropped: int, kernel: str) -> bytes:
    return fmt.encode(
        schema.fields(schema.COVERAGE, time=time.time(), reason=reason, groups=groups, dropped=dropped, kernel=kernel)
    )


# -- the trace and what its records number ---------------------------------------------------------


class TraceRecords:
    """This rank's trace file (``TraceWriter``), the lock every writer takes, and the numbering:
    event ids, group ids and sequence numbers, call-site ids, records written and dropped."""

    def __init__(self, max_events: int, events: Callable[[], int], on_stop: Callable[[], None]):
        self.max_events = max_events
        self.lock = threading.Lock()
        self.writer = TraceWriter(events=events, on_stop=on_stop)
        self.write = self.writer.write
        self.ranks = GroupRanks()
        self.next_event = 0
        self.written = 0
        self.dropped = 0
        self.group_ids: dict[str, int] = {}
        self.seq: dict[str, int] = {}
        self.p2p_seq: dict[tuple, int] = {}
        self.sites: dict[tuple, int] = {}

    # -- interning (called under the lock) -----------------------------------------------------

    def group_id(self, name: str) -> int:
        gid = self.group_ids.get(name)
        if gid is None:
            gid = self.group_ids[name] = len(self.group_ids)
            self.write(fmt.encode(group_fields(name, self.ranks.of(name), id=gid)))
        return gid

    def site_id(self, site_key: tuple) -> int:
        sid = self.sites.get(site_key)
        if sid is None:
            sid = self.sites[site_key] = len(self.sites)
            self.write(fmt.encode(site_fields(site_key, id=sid)))
        return sid

    def count_p2p(self, group_name: str) -> None:
        key = ("#p2p", group_name)
        self.p2p_seq[key] = self.p2p_seq.get(key, 0) + 1

    def p2p_count(self, group_name: str) -> int:
        return self.p2p_seq.get(("#p2p", group_name), 0)

    def drop(self) -> None:
        """One collective over the cap: the ``cap`` record the first time, counted always."""
        if self.dropped == 0:
            self.write(cap_line(self.max_events))
        self.dropped += 1

    # -- records written at once, under the lock ----------------------------------------------------

    def write_locked(self, data: bytes) -> None:
        with self.lock:
            self.write(data)
