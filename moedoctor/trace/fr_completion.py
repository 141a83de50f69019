"""Which of moedoctor's collectives PyTorch's Flight Recorder shows complete.

On NCCL (torch >= 2.8) a collective issued with ``async_op=False`` hands the dispatcher no ``Work``
(``ProcessGroupNCCL`` returns a null one: the caller does not wait on the host), so the recorder
cannot watch it; functional collectives are never watched. PyTorch's own Flight Recorder keeps
every collective of every NCCL group with its state, which its watchdog updates from the CUDA end
event. This module fuses the two by (process group name, collective sequence number):

* ``FrEntry`` / ``entries_from_dump`` / ``entries_from_events``: Flight Recorder entries reduced to
  what the fusion needs (the dump format is read by ``moedoctor.trace.flight_recorder``; the states
  by its ``_completed``).
* ``fuse``: a dump taken at a hang against a rank's trace, at analysis time: each collective is
  completed, pending (Flight Recorder shows it scheduled or started) or unknown (older than the ring
  buffer, not recorded, or after the dump).
* ``LiveTracker``: the recorder's progress thread following its own trace, deciding from cheap
  ``onlyActive`` dumps which collectives are now proven complete.

How the numbers agree (checked on torch 2.11 NCCL and 2.13 Gloo): Flight Recorder's
``collective_seq_id`` counts, per group, each collective the backend launches, from 1: one per
c10d collective, one per functional collective (its c10d call is the same launch), one per
coalesced op (``all_reduce_coalesced``, ``all_gather_into_tensor_coalesced``, a fast-path
``_coalescing_manager``). p2p ops do not advance it: they carry the count before them, as
moedoctor's ``seq`` does, and ``p2p_seq_id`` counts them per group (a ``batch_isend_irecv`` shares
one, and its completion is the ``nccl:coalesced`` entry right after it). So moedoctor's ``seq``
equals ``collective_seq_id`` except where one dispatcher op is several launches or the reverse
(Gloo's ``monitored_barrier``, which Flight Recorder does not record); every match is therefore
checked by op (and input size where both are plain), and a group whose ops disagree is not fused
from the first disagreement on. No torch here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from moedoctor.trace import schema
from moedoctor.trace.flight_recorder import _completed, _group_key, _last_completed, normalize_op

#: Where a completion came from, as the analysis names it.
SOURCE_WORK = "work"  # the recorder saw the collective's Work complete (``d`` records)
SOURCE_FR_LIVE = "flight-recorder"  # the recorder's progress thread, from Flight Recorder (``d`` with ``src``)
SOURCE_FR_DUMP = "flight-recorder-dump"  # the analysis, from the dumps in RUN_DIR/flight_recorder
#: The value of a ``d`` record's ``src`` key written by the progress thread.
DONE_SOURCE_FR = "fr"

#: Ops whose input element count is the same in the trace and in the Flight Recorder entry, on
#: every backend (the check that catches a sequence offset between two identical-looking ops).
_SAME_INPUT = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "all_reduce_coalesced"})

#: Flight Recorder ops (normalized) a trace op may be recorded as, besides its own name.
_ALIASES = {
    "reduce_scatter": {"all_reduce", "reduce_scatter_coalesced", "reduce"},  # Gloo emulates it; uneven lists
    "all_reduce_coalesced": {"all_reduce"},  # Gloo: one all_reduce, several inputs
    "all_gather": {"all_gather_coalesced", "broadcast"},  # functional all_gather; uneven lists
    "all_gather_coalesced": {"all_gather"},
    "reduce_scatter_coalesced": {"reduce_scatter", "all_reduce"},
    "all_reduce": {"all_reduce_coalesced"},
}


@dataclass(frozen=True, slots=True)
class FrEntry:
    """One Flight Recorder entry, as much as the fusion needs."""

    group: str
    seq: int  # collective_seq_id
    is_p2p: bool
    op: str  # normalized (``normalize_op``)
    record_id: int
    done: float | None  # Flight Recorder shows it completed: when (the issue time where unknown)
    numel: int | None = None  # input elements, all inputs together
    peer: int | None = None  # p2p: the peer as the source gave it (group rank in dumps, global in events)
    p2p_seq: int | None = None


def compatible(trace_op: str, fr_op: str) -> bool:
    """Whether a trace's op and a Flight Recorder entry at the same sequence number are one collective."""
    if trace_op == fr_op or fr_op == "coalesced":
        return True
    return fr_op in _ALIASES.get(trace_op, ())


def _numel(sizes) -> int | None:
    try:
        total = 0
        for shape in sizes:
            n = 1
            for d in shape:
                n *= int(d)
            total += n
        return total
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Entries


def entries_from_dump(raw: dict) -> list[FrEntry]:
    """The entries of a dump as ``_dump_nccl_trace`` / ``_dump_fr_trace`` return it (unpickled).
    Malformed entries are skipped: completion is then unknown, never wrong."""
    if not isinstance(raw, dict):
        return []
    entries = raw.get("entries")
    if not isinstance(entries, list):
        return []
    completed_upto = _last_completed(raw.get("pg_status"))
    names: dict[str, tuple[str, int | None]] = {}
    out = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        try:
            key = _group_key(entry)
            raw_op = entry["profiling_name"]
            if key is None or not isinstance(raw_op, str):
                continue
            named = names.get(raw_op)
            if named is None:
                named = names[raw_op] = normalize_op(raw_op)
            op, peer = named
            is_p2p = entry.get("is_p2p")
            if not isinstance(is_p2p, bool):
                is_p2p = op in ("send", "recv")
            seq = entry.get("collective_seq_id")
            record_id = entry.get("record_id")
            if not (_plain_int(seq) and _plain_int(record_id)):
                continue
            created = entry.get("time_created_ns")
            time = created / 1e9 if isinstance(created, int | float) and not isinstance(created, bool) else 0.0
            p2p_seq = entry.get("p2p_seq_id")
            out.append(
                FrEntry(
                    group=key[0],
                    seq=seq,
                    is_p2p=is_p2p,
                    op=op,
                    record_id=record_id,
                    done=_completed(entry, raw_op, time, completed_upto),
                    numel=_numel(entry.get("input_sizes") or ()),
                    peer=peer if is_p2p else None,
                    p2p_seq=p2p_seq if _plain_int(p2p_seq) else None,
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            continue
    return _fold_p2p_batches(out)


def entries_from_events(events) -> list[FrEntry]:
    """The entries of one rank's dump as ``read_flight_recorder`` made them into events."""
    out = [
        FrEntry(
            group=e.group.name,
            seq=e.seq,
            is_p2p=e.is_p2p,
            op=e.op,
            record_id=e.event_id,
            done=e.completed,
            numel=_numel(e.in_shapes),
            peer=e.peer,
            p2p_seq=e.p2p_seq,
        )
        for e in events
    ]
    return _fold_p2p_batches(out)


def _fold_p2p_batches(entries: list[FrEntry]) -> list[FrEntry]:
    """A ``batch_isend_irecv`` is recorded as its sends and receives (which never leave
    ``scheduled``: they have no CUDA events of their own) followed by one ``nccl:coalesced`` entry
    that carries the batch's state. Give that state to the p2p entries and drop the coalesced one,
    so that it is not taken for the collective of the same ``collective_seq_id``."""
    entries = sorted(entries, key=lambda e: e.record_id)
    out: list[FrEntry] = []
    for e in entries:
        if e.op == "coalesced" and not e.is_p2p and out and out[-1].is_p2p and out[-1].group == e.group:
            i = len(out)
            while i > 0 and out[i - 1].is_p2p and out[i - 1].group == e.group and out[i - 1].seq == e.seq:
                i -= 1
            for j in range(i, len(out)):
                if out[j].done is None and e.done is not None:
                    out[j] = FrEntry(
                        out[j].group,
                        out[j].seq,
                        True,
                        out[j].op,
                        out[j].record_id,
                        e.done,
                        out[j].numel,
                        out[j].peer,
                        out[j].p2p_seq,
                    )
            continue
        out.append(e)
    return out


def _plain_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------------------------------------
# Analysis time: one rank's trace against its dump


@dataclass
class _Slot:
    """Every entry of one (group, collective_seq_id): one collective, or one coalesced batch."""

    ops: list[str] = field(default_factory=list)
    numels: list[int | None] = field(default_factory=list)
    done: float | None = None
    batch_done: float | None = None  # the batch's own ``coalesced`` entry, when there is one
    has_batch: bool = False

    @property
    def state(self) -> float | None:
        return self.batch_done if self.has_batch else self.done


def _slots(entries: Iterable[FrEntry]) -> dict[tuple[str, int], _Slot]:
    slots: dict[tuple[str, int], _Slot] = {}
    for e in entries:
        if e.is_p2p:
            continue
        slot = slots.setdefault((e.group, e.seq), _Slot())
        slot.ops.append(e.op)
        slot.numels.append(e.numel)
        if e.op == "coalesced":
            slot.has_batch = True
            slot.batch_done = e.done
        elif e.done is not None:
            slot.done = e.done if slot.done is None else max(slot.done, e.done)
    return slots


def _matches(op: str, numel: int | None, slot: _Slot) -> bool:
    for fr_op, fr_numel in zip(slot.ops, slot.numels):
        if not compatible(op, fr_op):
            continue
        if op == fr_op and op in _SAME_INPUT and numel is not None and fr_numel is not None and numel != fr_numel:
            continue
        return True
    return False


@dataclass
class Fusion:
    """What a dump says of one rank's collectives (by event id)."""

    done: dict[int, float] = field(default_factory=dict)  # newly known complete: event id -> when
    pending: set[int] = field(default_factory=set)  # Flight Recorder shows it not completed
    unknown: set[int] = field(default_factory=set)  # Flight Recorder cannot tell
    misaligned: dict[str, int] = field(default_factory=dict)  # group -> first seq whose ops disagree
    contradicted: dict[str, int] = field(default_factory=dict)  # group -> seqs shown done after a pending one


def fuse(events, entries: list[FrEntry]) -> Fusion:
    """Fuse one rank's Flight Recorder entries into its trace's collectives (``CollectiveEvent``s).

    Only collectives the trace has no completion for are decided; the trace's own completions are
    used for the group-order rule: one group's collectives complete in issue order (on NCCL, one
    communicator's kernels run in order), so a completed collective proves every earlier one of its
    group complete. A collective that Flight Recorder shows completed *after* one it shows pending
    in the same group is not believed (an entry whose CUDA end event was not yet recorded reads as
    completed): it stays unknown."""
    slots = _slots(entries)
    p2p = _p2p_index(entries)
    wrapped = bool(entries) and min(e.record_id for e in entries) > 0
    fusion = Fusion()
    by_group: dict[str, list] = {}
    for e in events:
        by_group.setdefault(e.group.name, []).append(e)
    for name, group_events in by_group.items():
        colls = sorted((e for e in group_events if not e.is_p2p), key=lambda e: e.seq)
        states: dict[int, tuple[str, float | None]] = {}  # event id -> ("done" | "pending" | "unknown", when)
        first_bad = None
        recorded = [s for (g, s) in slots if g == name]
        lo, hi = (min(recorded), max(recorded)) if recorded else (0, 0)
        for e in colls:
            slot = slots.get((name, e.seq))
            if slot is None and lo < e.seq < hi and first_bad is None:
                first_bad = e.seq  # a gap inside the buffer: the numberings differ (Gloo's monitored_barrier)
                fusion.misaligned[name] = e.seq
            if slot is None or (first_bad is not None and e.seq >= first_bad):
                states[e.event_id] = ("unknown", None)
                continue
            if not _matches(e.op, _numel(e.in_shapes) if e.in_shapes else None, slot):
                first_bad = e.seq
                fusion.misaligned[name] = e.seq
                states[e.event_id] = ("unknown", None)
                continue
            when = slot.state
            states[e.event_id] = ("done", when) if when is not None else ("pending", None)
        # Completed after a pending one of the same group: not believed.
        first_pending = min(
            (e.seq for e in colls if states[e.event_id][0] == "pending" and e.completed is None), default=None
        )
        if first_pending is not None:
            for e in colls:
                if e.seq > first_pending and states[e.event_id][0] == "done":
                    states[e.event_id] = ("unknown", None)
                    fusion.contradicted.setdefault(name, e.seq)
        # The group-order rule, from the latest collective known complete (trace or dump).
        latest, latest_when = None, None
        for e in reversed(colls):
            if e.completed is not None or states[e.event_id][0] == "done":
                latest, latest_when = e.seq, e.completed if e.completed is not None else states[e.event_id][1]
                break
        for e in colls:
            if e.completed is not None:
                continue
            kind, when = states[e.event_id]
            if kind == "done":
                fusion.done[e.event_id] = when
            elif latest is not None and e.seq < latest:
                fusion.done[e.event_id] = latest_when
            elif kind == "pending":
                fusion.pending.add(e.event_id)
            else:
                fusion.unknown.add(e.event_id)
        for e in group_events:
            if not e.is_p2p or e.completed is not None:
                continue
            entry = None if wrapped else _p2p_entry(p2p, name, e)
            if entry is None:
                fusion.unknown.add(e.event_id)
            elif entry.done is not None:
                fusion.done[e.event_id] = entry.done
            else:
                fusion.pending.add(e.event_id)
    return fusion


def _p2p_index(entries: Iterable[FrEntry]) -> dict[tuple[str, int], list[FrEntry]]:
    """p2p entries per (group, peer), in record order: the k-th is the trace's p2p op number k
    with that peer (moedoctor's ``p2p_seq`` counts per peer, Flight Recorder's per group)."""
    index: dict[tuple[str, int], list[FrEntry]] = {}
    for e in sorted(entries, key=lambda e: e.record_id):
        if e.is_p2p and e.peer is not None:
            index.setdefault((e.group, e.peer), []).append(e)
    return index


def _p2p_entry(index, group: str, event) -> FrEntry | None:
    if event.peer is None or event.p2p_seq is None:
        return None
    entries = index.get((group, event.peer), [])
    if not 0 < event.p2p_seq <= len(entries):
        return None
    entry = entries[event.p2p_seq - 1]
    return entry if entry.op == event.op else None


# ---------------------------------------------------------------------------------------------
# Run time: the recorder's progress thread following its own trace

#: A collective record as both recorders write it (keys in the schema's order); others go through json.
#: How the lines followed begin (``{"k":"c"``), from the schema.
_COLLECTIVE, _DONE, _GROUP = (schema.line_prefix(r) for r in (schema.COLLECTIVE, schema.DONE, schema.GROUP))
_C_RECORD = re.compile(schema.line_pattern("th", ("i", "g", "seq", "pseq", "op", "raw", "in", "th"), strings=("th",)))


@dataclass(slots=True)
class _Pending:
    event_id: int
    op: str
    shapes: bytes | list | None  # the record's "in" (JSON text until needed)
    thread: bytes | str

    def numel(self) -> int | None:
        shapes = self.shapes
        if isinstance(shapes, bytes):
            try:
                shapes = self.shapes = json.loads(shapes)
            except ValueError:
                shapes = self.shapes = None
        return None if shapes is None else _numel(shapes)


@dataclass(slots=True)
class _PendingP2P:
    group: str
    peer: int  # the peer's rank in the group (Flight Recorder's profiling names count so)
    pseq: int  # moedoctor's count of p2p ops with that peer in that group, from 1
    op: str
    thread: bytes | str


class LiveTracker:
    """This rank's collectives whose completion has not been seen yet, read from its own trace as
    it grows, and the rules that prove them complete from Flight Recorder.

    ``wanted(group name, raw op)`` says which collectives to follow (the recorder follows every
    collective of an NCCL group, and only the functional ones elsewhere: the others report
    completion through their ``Work``). p2p ops of wanted groups are followed apart
    (``p2p_pending``): on NCCL a send/recv inside ``batch_isend_irecv`` gets a null ``Work``;
    ``resolve_p2p`` decides them from a full dump."""

    #: Flight Recorder entries one recorded op can make at most, for the ring-buffer bound (an
    #: uneven list all_gather on NCCL is a coalesced batch of broadcasts; a p2p batch adds one).
    ENTRIES_PER_OP = 4
    #: p2p ops followed at most: past that many, Flight Recorder's ring buffer (2000 entries by default)
    #: has wrapped and per-peer order can no longer be matched, so p2p ops stop being followed.
    MAX_P2P = 4096

    def __init__(self, wanted: Callable[[str, str], bool], max_pending: int = 100_000):
        self._wanted = wanted
        self._max_pending = max_pending
        self._partial = b""
        self._groups: dict[int, str] = {}
        self._group_ranks: dict[int, tuple[int, ...]] = {}
        self.p2p_pending: dict[int, _PendingP2P] = {}  # event id -> the p2p op followed
        self.p2p_followed = 0  # p2p ops followed so far (``MAX_P2P``)
        self.pending: dict[str, dict[int, _Pending]] = {}
        self._where: dict[int, tuple[str, int]] = {}
        self.top_seq: dict[str, int] = {}  # highest collective seq recorded per group
        self.last_event = -1
        self._thread_last: dict[bytes | str, int] = {}  # thread -> its latest event id
        self.misaligned: dict[str, str] = {}  # group -> why Flight Recorder is not used for it
        self.p2p_groups: set[str] = set()  # groups with p2p ops (their pg_status mixes numberings)
        self._disagree: dict[str, int] = {}
        self.parse_errors = 0
        self.skipped = 0  # records passed over by skip()

    # -- following the trace --------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """New bytes of the trace file (any split; a partial last line waits for the rest)."""
        data, end = self._whole_lines(data)
        if end < 0:
            return
        for line in data[:end].split(b"\n"):
            if line.startswith(_COLLECTIVE):
                self._collective(line)
            elif line.startswith(_DONE):
                self._done(line)
            elif line.startswith(_GROUP):
                self._group(line)

    def skip(self, data: bytes) -> None:
        """Bytes of the trace passed over (the poller fell further behind than Flight Recorder can
        say anything about): only their group records are read, and what was followed so far is
        dropped. Its completion stays unknown here; the analysis takes it from a later collective of
        its group. Dropping it also keeps ``top_seq`` honest: a group followed again is one whose
        newest records were read."""
        data, end = self._whole_lines(data)
        if end < 0:
            return
        self.skipped += data.count(b"\n", 0, end + 1)
        pos = 0
        while (i := data.find(_GROUP, pos, end)) >= 0:
            stop = data.find(b"\n", i, end + 1)
            if i == 0 or data[i - 1] == 0x0A:
                self._group(data[i:stop])
            pos = stop + 1
        self.pending.clear()
        self._where.clear()
        self.p2p_pending.clear()

    def _whole_lines(self, data: bytes) -> tuple[bytes, int]:
        """The held partial line and ``data`` joined, and where their last whole line ends (-1: none
        yet); what follows it is held for the next call."""
        data = self._partial + data
        end = data.rfind(b"\n")
        self._partial = data if end < 0 else data[end + 1 :]
        return data, end

    def _group(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
            self._groups[int(rec["id"])] = str(rec["name"])
            self._group_ranks[int(rec["id"])] = tuple(int(r) for r in rec.get("ranks") or ())
        except (ValueError, KeyError, TypeError):
            self.parse_errors += 1

    def _collective(self, line: bytes) -> None:
        m = _C_RECORD.match(line)
        if m is not None:
            event_id, gid, seq = int(m.group(1)), int(m.group(2)), int(m.group(3))
            p2p, op, raw = m.group(4) is not None, m.group(5).decode(), m.group(6).decode()
            shapes, thread = m.group(7), m.group(8)
        else:
            try:
                rec = json.loads(line)
                event_id, gid, seq = int(rec["i"]), int(rec["g"]), int(rec["seq"])
                p2p, op, raw = "pseq" in rec or "peer" in rec, str(rec["op"]), str(rec["raw"])
                shapes, thread = rec.get("in"), json.dumps(rec.get("th"))
            except (ValueError, KeyError, TypeError):
                self.parse_errors += 1
                return
            thread = thread.encode()
        self.last_event = max(self.last_event, event_id)
        self._thread_last[thread] = max(event_id, self._thread_last.get(thread, -1))
        name = self._groups.get(gid)
        if name is None:
            return
        if p2p:
            self.p2p_groups.add(name)
            if self.p2p_followed <= self.MAX_P2P and self._wanted(name, raw):
                self._follow_p2p(line, event_id, gid, name, op, thread)
            return
        self.top_seq[name] = max(seq, self.top_seq.get(name, 0))
        if not self._wanted(name, raw):
            return
        self.pending.setdefault(name, {})[seq] = _Pending(event_id, op, shapes, thread)
        self._where[event_id] = (name, seq)
        if len(self._where) > self._max_pending:
            self._drop_oldest()

    def _follow_p2p(self, line: bytes, event_id: int, gid: int, name: str, op: str, thread: bytes | str) -> None:
        try:
            rec = json.loads(line)
            peer, pseq = int(rec["peer"]), int(rec["pseq"])
            ranks = self._group_ranks.get(gid, ())
            peer = ranks.index(peer) if ranks else peer
        except (ValueError, KeyError, TypeError):
            return  # completion stays unknown
        self.p2p_followed += 1
        if self.p2p_followed > self.MAX_P2P:
            self.p2p_pending.clear()  # the ring buffer cannot match them any more: unknown
            return
        self.p2p_pending[event_id] = _PendingP2P(name, peer, pseq, op, thread)

    def _done(self, line: bytes) -> None:
        try:
            ids = json.loads(line)["i"]
        except (ValueError, KeyError, TypeError):
            self.parse_errors += 1
            return
        for event_id in ids if isinstance(ids, list) else (ids,):
            self.forget(event_id)

    def forget(self, event_id) -> None:
        self.p2p_pending.pop(event_id, None)
        where = self._where.pop(event_id, None)
        if where is not None:
            group = self.pending.get(where[0])
            if group is not None:
                group.pop(where[1], None)
                if not group:
                    del self.pending[where[0]]

    def _drop_oldest(self) -> None:
        for event_id in sorted(self._where)[: len(self._where) - self._max_pending]:
            self.forget(event_id)  # its completion stays unknown

    def has_pending(self, groups: Iterable[str] | None = None) -> bool:
        if groups is None:
            return bool(self.pending) or bool(self.p2p_pending)
        return any(g in self.pending for g in groups) or self.has_p2p_pending(groups)

    def has_p2p_pending(self, groups: Iterable[str]) -> bool:
        wanted = set(groups)
        return any(p.group in wanted for p in self.p2p_pending.values())

    def pending_groups(self) -> list[str]:
        """Every group with a collective or p2p op followed, in a stable order."""
        groups = list(self.pending)
        return groups + sorted({p.group for p in self.p2p_pending.values()} - set(groups))

    # -- deciding -------------------------------------------------------------------------------

    def _claim(self, group: str, upto: int) -> list[int]:
        """Every followed collective of ``group`` with seq <= ``upto`` (the group-order rule)."""
        pending = self.pending.get(group, {})
        ids = [p.event_id for s, p in pending.items() if s <= upto]
        for event_id in ids:
            self.forget(event_id)
        return ids

    def _verified(self, group: str, entries: list[FrEntry], full: bool = False) -> bool:
        """Every entry of the group at a seq we follow has that collective's op (and, from a dump
        of every entry, no followed seq falls in a gap of the buffer): else the group's numbering
        disagrees with Flight Recorder's, and it is not used any more."""
        pending = self.pending.get(group, {})
        slots = {seq: slot for (_, seq), slot in _slots(entries).items()}
        for seq, slot in slots.items():
            p = pending.get(seq)
            if p is not None and not _matches(p.op, p.numel(), slot):
                self.misaligned[group] = (
                    f"Flight Recorder's collective #{seq} is {'/'.join(slot.ops)}, the trace's is {p.op}"
                )
                return False
        if full and slots:
            lo, hi = min(slots), max(slots)
            gap = next((seq for seq in sorted(pending) if lo < seq < hi and seq not in slots), None)
            if gap is not None:
                self.misaligned[group] = f"Flight Recorder has no collective #{gap} between #{lo} and #{hi}"
                return False
        return True

    def resolve_states(self, entries: list[FrEntry], groups: Iterable[str], launched: bool = False) -> list[int]:
        """From a dump listing every entry with its state (Gloo's, or any full dump): collectives
        Flight Recorder shows completed, and every earlier one of their group. ``launched`` (NCCL):
        only those whose thread has issued a later op (see ``resolve_active``)."""
        out: list[int] = []
        by_group: dict[str, list[FrEntry]] = {}
        for e in entries:
            if not e.is_p2p:
                by_group.setdefault(e.group, []).append(e)
        for group in groups:
            if group in self.misaligned or group not in self.pending:
                continue
            mine = by_group.get(group, [])
            if not self._verified(group, mine, full=True):
                continue
            slots = _slots(mine)
            pending_seqs = sorted(s for (g, s), slot in slots.items() if slot.state is None)
            first_pending = pending_seqs[0] if pending_seqs else None
            pending = self.pending.get(group, {})
            done = [
                s
                for (g, s), slot in slots.items()
                if slot.state is not None
                and (first_pending is None or s < first_pending)
                and s in pending
                and (not launched or self._thread_last.get(pending[s].thread, -1) > pending[s].event_id)
            ]
            if done:
                out += self._claim(group, max(done))
        return out

    def resolve_p2p(self, entries: list[FrEntry], groups: Iterable[str], launched: bool = False) -> list[int]:
        """From a dump listing every entry with its state (a full dump): the followed p2p ops of
        ``groups`` that Flight Recorder shows completed. A p2p op is matched as at analysis time
        (``fuse``): per group and peer, in record order (moedoctor's ``pseq`` counts per peer,
        Flight Recorder's ``p2p_seq_id`` per group), with the same op; a ``batch_isend_irecv``'s
        sends and receives take its ``nccl:coalesced`` entry's state. Only while the ring buffer
        still holds the group's first entries (record 0 is there): else the k-th is not known.
        ``launched``: only ops whose thread has issued a later op (an entry read while its call is
        still launching reads as completed)."""
        if not entries or min(e.record_id for e in entries) > 0:
            return []
        wanted = set(groups)
        index = _p2p_index(entries)
        out: list[int] = []
        for event_id, p in list(self.p2p_pending.items()):
            if p.group not in wanted:
                continue
            if launched and self._thread_last.get(p.thread, -1) <= event_id:
                continue
            found = index.get((p.group, p.peer), [])
            if not 0 < p.pseq <= len(found):
                continue
            entry = found[p.pseq - 1]
            if entry.op == p.op and entry.done is not None:
                out.append(event_id)
                del self.p2p_pending[event_id]
        return out

    def resolve_active(
        self,
        active: list[FrEntry],
        backend_seq: dict[str, int],
        tops_before: dict[str, int],
        settled: int,
        window: int,
        final: bool = False,
        last_completed: dict[str, int] | None = None,
    ) -> list[int]:
        """From an ``onlyActive`` NCCL dump (it lists only the entries not yet completed).

        A followed collective ``s`` of group ``g`` is complete when Flight Recorder recorded it and
        no longer lists it, which is proven when:
          * ``g``'s numbering agrees with the backend's: the group's own sequence counter (read just
            before the dump) equals the highest seq the trace holds for ``g``, before and after it;
          * ``s`` was issued to the backend (``s`` <= that counter) at least one poll ago
            (``event id <= settled``: Flight Recorder recorded it in the same call);
          * no entry of ``g`` at or before ``s`` is listed (collectives of a group complete in order);
          * the ring buffer cannot have dropped it: fewer than ``window / ENTRIES_PER_OP`` ops
            were recorded after it;
          * the thread that issued it has issued a later op (it returned from that call: an entry
            read while its call is still launching the kernel has no CUDA event yet and would read
            as completed), unless ``final`` (the rank is shutting its groups down).
        Then ``s`` and every earlier followed collective of ``g`` are complete. Also, without the
        last three conditions: ``s`` <= the dump's ``pg_status.last_completed_collective`` of ``g``
        (``last_completed``: the sequence number of a Work the watchdog found complete; it sees a
        Work only once its end event is recorded, and the ring buffer does not bound it), where
        ``g`` had no p2p op (a p2p Work's number counts p2p ops)."""
        out: list[int] = []
        listed: dict[str, list[FrEntry]] = {}
        for e in active:
            if not e.is_p2p:
                listed.setdefault(e.group, []).append(e)
        for group in list(self.pending):
            if group in self.misaligned or group not in backend_seq:
                continue
            count, before, now = backend_seq[group], tops_before.get(group), self.top_seq.get(group)
            if before is None or before != now or count != now:
                if before == now and count not in (now, now - 1):  # quiet, and still not equal
                    self._disagree[group] = self._disagree.get(group, 0) + 1
                    if self._disagree[group] >= 3:
                        self.misaligned[group] = (
                            f"the group's sequence counter says {count}, the trace has {now} collectives"
                        )
                continue
            self._disagree.pop(group, None)
            mine = listed.get(group, [])
            if not self._verified(group, mine):
                continue
            floor = min((e.seq for e in mine), default=None)
            best = None
            status = None if last_completed is None or group in self.p2p_groups else last_completed.get(group)
            if status is not None and status > 0:
                best = min(status, count)
            for seq, p in self.pending[group].items():
                if floor is not None and seq >= floor:
                    continue
                if seq > count or p.event_id > settled:
                    continue
                if (self.last_event - p.event_id) * self.ENTRIES_PER_OP >= window:
                    continue
                if not final and self._thread_last.get(p.thread, -1) <= p.event_id:
                    continue
                best = seq if best is None else max(best, seq)
            if best is not None:
                out += self._claim(group, best)
        return out
