"""Online desync detection for ``moedoctor run``: compare the ranks' collective streams as the
watchdog reads them, and report the first mismatch as soon as every involved rank has issued its side.

``DesyncDetector.feed`` is called by the ``ProgressTracker`` with each rank's newly parsed records
(records are parsed once, for both). Per group and sequence number the detector keeps the events of
the members that reported it; an entry is dropped once every member has, so memory follows the ranks'
lag, not the length of the run. Two members' events at one (group, seq) are compared with the offline
analyzer's own definition (``moedoctor.analysis.matching.op_classes``: op, shapes, dtypes, and the
reduce op where both are known); the first disagreement is a ``Desync``.

``check_lags`` looks for a member that falls behind its group by a whole step while the others wait
in a collective: a ``Lag``. A lag may be a straggler, not a desync: it is reported, never acted on.

Point-to-point ops are not compared online: they do not advance the group's seq, and the order of a
batch's sends and receives need not agree across a peer pair, so a per-pair comparison could raise a
false alarm on a healthy job. A p2p hang is still caught by the hang watchdog and the offline analysis.

The times compared with ``Desync.issued_at`` are the ranks' wall clocks (trace records); across hosts
the detection latency includes their clock offset.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moedoctor.analysis.contracts import breaches, contract_classes
from moedoctor.events import CONTRACT_OPS, P2P_OPS, CollectiveEvent

#: Members waiting this long without progress, at a seq a member has not reached, make a lag.
LAG_IDLE = 1.0
#: Pending seqs kept per group at most (a member that never reports must not grow memory forever).
MAX_PENDING = 100_000


def describe(e: CollectiveEvent, detail: bool = False) -> str:
    """An op as the finding's line shows it: its name, with shapes and dtypes when ``detail``."""
    if not detail:
        return e.op
    shapes = ",".join("x".join(map(str, s)) or "scalar" for s in (e.in_shapes or e.out_shapes)) or "-"
    red = f" {e.reduce_op}" if e.reduce_op else ""
    return f"{e.op}[{shapes}] {'/'.join(e.dtypes) or '-'}{red}"


def first_mechanism(a: CollectiveEvent, b: CollectiveEvent) -> str:
    """The mechanism two members' events at one sequence number show (``analysis.mechanisms``'s
    vocabulary and definitions, without the history the offline analysis reads): the same op from
    two call sites is two collectives (``different-op``), as offline."""
    sites = {x.call_site.where for x in (a, b) if x.call_site is not None}
    if a.op != b.op or len(sites) > 1:
        return "different-op"
    if a.in_shapes != b.in_shapes or a.out_shapes != b.out_shapes:
        return "different-shape"
    if a.dtypes != b.dtypes:
        return "different-dtype"
    if a.reduce_op and b.reduce_op and a.reduce_op != b.reduce_op:
        return "different-reduce-op"
    return "different-op"  # same arguments, another signature field (another unit or root)


#: What the first report says of level 2: two collectives at one position are a mechanism, never a
#: pattern's evidence (``analysis.patterns``' declarations: every pattern needs the ranks' history or domain
#: evidence the report reads once the stacks are in).
NO_PATTERN_YET = "pattern not named yet: it needs the ranks' history and its own evidence, read next"


@dataclass(frozen=True)
class Desync:
    """Two members of a group issued different collectives at the same sequence number."""

    group: str
    group_desc: str
    group_ranks: tuple[int, ...]
    seq: int
    ops: dict[int, str]  # rank -> op, for the members that reported it
    classes: list[tuple[int, ...]]  # ranks that did the same thing (op_classes)
    ranks: tuple[int, int]  # the two ranks the line names
    issued_at: float  # the later of those two issue times (ranks' wall clock)
    detected_at: float  # when the detector saw it (this host's wall clock)
    reason: str | None = None  # a size contract broken (all_to_all splits): which pair
    #: Level 1 (``moedoctor.analysis.mechanisms``) as far as two events at one seq tell: the same op
    #: with other shapes / dtypes / reduce op, a broken size contract (splits), or another op there
    #: (the offline analysis, with the history, may call that an extra, skipped or looped one).
    mechanism: str | None = None

    @property
    def latency(self) -> float:
        return self.detected_at - self.issued_at

    def line(self) -> str:
        a, b = self.ranks
        desc = self.group_desc if self.group_desc and self.group_desc != self.group else None
        where = f"group {self.group}" + (f" ({desc})" if desc else "")
        how = f" (mechanism {self.mechanism}; {NO_PATTERN_YET})" if self.mechanism else ""
        if self.reason:
            return f"{where} #{self.seq}, {self.ops[a].split('[')[0]}: {self.reason}{how}"
        return f"{where} #{self.seq}, rank {a} {self.ops[a]} vs rank {b} {self.ops[b]}{how}"


@dataclass(frozen=True)
class Lag:
    """Members of a group wait at ``seq`` while ``rank`` has not reached it and is a step behind."""

    group: str
    seq: int
    step: int  # the waiting members' step
    waiting: tuple[int, ...]
    rank: int  # the member behind
    rank_seq: int  # its last seq on the group (0: none yet)
    rank_step: int  # the step of its latest collective on any group
    detected_at: float

    def line(self) -> str:
        waiting = ",".join(map(str, self.waiting))
        return (
            f"rank {self.rank} lags on group {self.group}: at #{self.rank_seq} (step {self.rank_step}) "
            f"while rank(s) {waiting} wait at #{self.seq} (step {self.step})"
        )


@dataclass
class _Entry:
    """One (group, seq) not yet reported by every member."""

    events: dict[int, CollectiveEvent]
    signature: tuple
    reduce_op: str | None


@dataclass
class DesyncDetector:
    """Fed by the ``ProgressTracker`` (``feed``), polled by the watchdog (``desync``, ``check_lags``)."""

    lag_idle: float = LAG_IDLE
    max_pending: int = MAX_PENDING
    clock: Callable[[], float] = time.time
    desync: Desync | None = None
    lags: list[Lag] = field(default_factory=list)
    records: int = 0  # collectives compared so far
    dropped: int = 0  # pending seqs dropped at max_pending
    _pending: dict[str, dict[int, _Entry]] = field(default_factory=dict)
    _last_seq: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> group -> seq
    _lag_seen: set = field(default_factory=set)

    # -- the stream ------------------------------------------------------------------------------

    def feed(self, rank: int, items: list, restarted: bool = False) -> None:
        """One rank's newly read records, in file order. ``restarted``: the rank has a new process."""
        if restarted:
            self.reset_rank(rank)
        for item in items:
            if type(item) is CollectiveEvent:
                self._event(item)

    def _event(self, e: CollectiveEvent) -> None:
        if e.op in P2P_OPS or e.peer is not None:
            return
        self.records += 1
        group = e.group
        lasts = self._last_seq.get(e.rank)
        if lasts is None:
            lasts = self._last_seq[e.rank] = {}
        if e.seq > lasts.get(group.name, 0):
            lasts[group.name] = e.seq
        members = len(group.ranks)
        if members < 2:
            return
        by_seq = self._pending.get(group.name)
        if by_seq is None:
            by_seq = self._pending[group.name] = {}
        entry = by_seq.get(e.seq)
        if entry is None:
            by_seq[e.seq] = _Entry({e.rank: e}, e.signature(), e.reduce_op)
            if len(by_seq) > self.max_pending:
                del by_seq[next(iter(by_seq))]
                self.dropped += 1
            return
        if e.rank in entry.events:
            return  # the same seq twice from one rank: not ours to judge here
        entry.events[e.rank] = e
        if e.signature() == entry.signature and (e.reduce_op is None or entry.reduce_op in (None, e.reduce_op)):
            # The fast path: op_classes would find one class (same signature, no two known reduce ops
            # that differ); anything else is decided by op_classes itself.
            entry.reduce_op = entry.reduce_op or e.reduce_op
        elif self.desync is None:
            # Imported here: moedoctor.analysis imports the runner's manifest, which imports this.
            from moedoctor.analysis.matching import op_classes

            classes = op_classes(entry.events)
            if len(classes) > 1:
                self.desync = self._finding(e, entry, classes)
        if len(entry.events) >= members:
            del by_seq[e.seq]
            if self.desync is None and e.op in CONTRACT_OPS:
                self._check_contract(e, entry)

    def _finding(self, e: CollectiveEvent, entry: _Entry, classes: list[tuple[int, ...]]) -> Desync:
        other_class = next(c for c in classes if e.rank not in c)
        other = min((entry.events[r] for r in other_class), key=lambda x: x.time)
        a, b = sorted((e, other), key=lambda x: x.rank)
        detail = a.op == b.op
        return Desync(
            group=e.group.name,
            group_desc=e.group.desc,
            group_ranks=e.group.ranks,
            seq=e.seq,
            ops={r: describe(x, detail) for r, x in sorted(entry.events.items())},
            classes=classes,
            ranks=(a.rank, b.rank),
            issued_at=max(a.time, b.time),
            detected_at=self.clock(),
            mechanism=first_mechanism(a, b),
        )

    def _check_contract(self, e: CollectiveEvent, entry: _Entry) -> None:
        """Every member issued this variable-size collective: do their sizes pair up?"""
        found = breaches(entry.events, e.group.ranks)
        if not found:
            return
        first = found[0]
        a, b = sorted((first.sender, first.receiver))
        self.desync = Desync(
            group=e.group.name,
            group_desc=e.group.desc,
            group_ranks=e.group.ranks,
            seq=e.seq,
            ops={r: describe(x, True) for r, x in sorted(entry.events.items())},
            classes=contract_classes(found, e.group.ranks),
            ranks=(a, b),
            issued_at=max(x.time for x in entry.events.values()),
            detected_at=self.clock(),
            reason=first.line(),
            mechanism="different-splits",
        )

    def reset_rank(self, rank: int) -> None:
        """A rank restarted: its sequence numbers start again, and so does every group it is in
        (an elastic restart restarts every rank; comparing an old process with a new one could only
        raise a false alarm)."""
        self._last_seq.pop(rank, None)
        for name, entries in list(self._pending.items()):
            entry = next(iter(entries.values()), None)
            if entry is None or rank in next(iter(entry.events.values())).group.ranks:
                del self._pending[name]

    def pending(self) -> int:
        """Seqs waiting for some member (the detector's memory)."""
        return sum(len(v) for v in self._pending.values())

    def last_seq(self, rank: int, group: str) -> int:
        return self._last_seq.get(rank, {}).get(group, 0)

    # -- lags ------------------------------------------------------------------------------------

    def check_lags(self, ranks: Mapping[int, Any], now: float) -> list[Lag]:
        """New lags, given the tracker's per-rank state (``RankProgress``: ``last``,
        ``last_completed``, ``last_progress`` on the monotonic clock ``now``). Each (group, seq,
        rank) is reported once."""
        waiting: dict[tuple[str, int], list] = {}
        for state in ranks.values():
            e = state.last
            if e is None or state.last_completed or e.op in P2P_OPS or now - state.last_progress < self.lag_idle:
                continue
            waiting.setdefault((e.group.name, e.seq), []).append(state)
        found = []
        for (name, seq), states in waiting.items():
            group = states[0].last.group
            step = max(s.last.step for s in states)
            waiters = {s.rank for s in states}
            for m in group.ranks:
                if m in waiters:
                    continue
                other = ranks.get(m)
                if other is None or other.last is None:
                    continue  # no trace yet: the hang watchdog's business
                behind = self.last_seq(m, name)
                if behind >= seq or other.last.step > step - 1:
                    continue
                key = (name, seq, m)
                if key in self._lag_seen:
                    continue
                self._lag_seen.add(key)
                lag = Lag(
                    group=name,
                    seq=seq,
                    step=step,
                    waiting=tuple(sorted(waiters)),
                    rank=m,
                    rank_seq=behind,
                    rank_step=other.last.step,
                    detected_at=self.clock(),
                )
                self.lags.append(lag)
                found.append(lag)
        return found
