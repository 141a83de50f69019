"""Busy is not stuck: what each rank is doing while the job's collectives are silent, and when that
silence is a hang.

A rank is, from evidence:

- ``waiting``: inside a collective that has not completed: its main thread's stack is in a
  collective or a ``Work.wait`` (``run_records.communication_frame``), or the recorder shows the
  collective issued and not completed (where it observes completions) and the rank makes no progress;
- ``working``: outside any collective, or computing (DTensor's dispatch is arithmetic, not a wait);
  whether it *progresses* is measured, not guessed: its main thread's CPU time, its I/O bytes, and a
  stack not seen before in this silence (``runner.activity``);
- ``stopped``: its process does not run (state ``T`` or ``t`` at every reading, or ``D`` with no
  progress for the whole timeout: a rank flushing a checkpoint is in ``D`` too, its bytes moving);
- ``dead``: its process is gone;
- ``unknown``: nothing to tell (no stack, no completion tracking, no ``/proc`` of it: another host).

The rule (``judge``): a hang is **proven** when some rank has waited in a collective for the whole
timeout while every rank it waits for (the other members of that collective's group) is waiting too,
stopped, dead, or working without any progress (no CPU, no I/O, no new stack) for the whole timeout.
Ranks that all work, or a waited-for rank that progresses, are **busy**: reported, never stopped.
Where evidence is missing the silence is **unproven**: the supervisor keeps watching and says what
is missing. Torch-free and below the runner, the triage and the analysis, which all use these states.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from moedoctor.wording import rank_names


class RankState(str, Enum):
    WAITING = "waiting"  # inside a collective that has not completed
    WORKING = "working"  # outside any collective (computing, saving, loading, stuck in its own code)
    STOPPED = "stopped"  # its process does not run (T, t, D)
    DEAD = "dead"  # its process is gone
    UNKNOWN = "unknown"  # no evidence either way


class Silence(str, Enum):
    HANG = "hang"  # proven: ranks wait on each other with no progress
    BUSY = "busy"  # ranks work (and the waited-for ones progress): never a reason to stop
    UNPROVEN = "unproven"  # evidence is missing: keep watching


@dataclass(frozen=True, slots=True)
class Pending:
    """The collective a rank issued last and has not been seen completing."""

    group: str
    seq: int
    op: str
    members: tuple[int, ...] = ()  # the group's global ranks (empty: not known)
    call_site: str | None = None

    def label(self) -> str:
        where = f" ({self.call_site})" if self.call_site else ""
        return f"{self.op} #{self.seq} of group {self.group}{where}"


@dataclass(frozen=True, slots=True)
class RankEvidence:
    """What the supervisor (or triage) knows of one rank when the job has been silent."""

    rank: int
    alive: bool | None = True  # False: the process is gone; None: cannot be read (another host)
    frozen: str | None = None  # T, t or D when every reading said the process does not run
    pending: Pending | None = None  # its last collective, not seen completing
    completion_tracked: bool = False  # the recorder observes completions of that collective's group
    stack_wait: str | None = None  # the torch.distributed function its main thread waits in
    stack_read: bool = False  # a stack of its main thread was read
    stack_stable: bool | None = True  # every sample showed the same stack (None: one sample only)
    where: str | None = None  # the job's own innermost frame, e.g. "save_checkpoint (train.py:88)"
    quiet_s: float | None = None  # seconds since it last progressed (CPU, I/O, new stack); None: not measured
    cpu_s: float = 0.0  # main-thread CPU seconds over the silence (for the account)
    io_bytes: int = 0  # bytes read and written over the silence (for the account)
    #: The state its own node judged (a rank of another node, through the job's rendezvous store).
    known: RankState | None = None

    def state(self, timeout: float) -> RankState:
        if self.known is not None:
            return self.known
        if self.alive is False:
            return RankState.DEAD
        if self.frozen in ("T", "t"):
            return RankState.STOPPED
        if self.frozen == "D" and (self.quiet_s is None or self.quiet_s >= timeout):
            # Uninterruptible sleep with no progress: stuck in the kernel. A rank writing a
            # checkpoint sits in D between its writes too, while its bytes move: that one works.
            return RankState.STOPPED
        if self.stack_wait is not None:
            # A wait is a stack that stays put: one sample is not enough (a rank passing through
            # torch.distributed code shows it for a moment), and a stack that moved is working.
            if self.stack_stable is None:
                return RankState.UNKNOWN
            return RankState.WAITING if self.stack_stable else RankState.WORKING
        if self.pending is not None and self.completion_tracked:
            # Issued and not completed. A rank that progresses computes meanwhile (overlap: working);
            # one that makes no progress waits for it (``work.wait()`` or ``loss.item()`` from its own
            # code). CPU spent spinning in a device synchronize is no progress: the supervisor leaves
            # it out of ``quiet_s`` (``runner.activity.device_wait``), and sets ``quiet_s`` to None
            # where it could not tell (then nothing is claimed).
            if self.quiet_s is None:
                return RankState.UNKNOWN if self.stack_read else RankState.WAITING
            return RankState.WORKING if self.quiet_s < timeout else RankState.WAITING
        if self.stack_read or self.quiet_s is not None:
            return RankState.WORKING
        return RankState.UNKNOWN

    def to_dict(self, timeout: float) -> dict:
        """What another node needs to judge with this rank (``from_dict``): its state as judged here."""
        p = self.pending
        return {
            "state": self.state(timeout).value,
            "quiet_s": self.quiet_s,
            "where": self.where,
            "stack_wait": self.stack_wait,
            "pending": None if p is None else [p.group, p.seq, p.op, list(p.members), p.call_site],
            "cpu_s": self.cpu_s,
            "io_bytes": self.io_bytes,
        }

    @classmethod
    def from_dict(cls, rank: int, doc: dict, age: float = 0.0) -> RankEvidence:
        """A rank judged by its own node, ``age`` seconds ago (its quiet time grows by as much)."""
        p = doc.get("pending")
        quiet = doc.get("quiet_s")
        return cls(
            rank,
            alive=None,
            pending=None if not p else Pending(str(p[0]), int(p[1]), str(p[2]), tuple(int(m) for m in p[3]), p[4]),
            stack_wait=doc.get("stack_wait"),
            where=doc.get("where"),
            quiet_s=None if quiet is None else float(quiet) + max(0.0, age),
            cpu_s=float(doc.get("cpu_s") or 0.0),
            io_bytes=int(doc.get("io_bytes") or 0),
            known=RankState(doc["state"]),
        )

    def progressing(self, timeout: float) -> bool | None:
        """Made progress within the timeout (None: not measured)."""
        return None if self.quiet_s is None else self.quiet_s < timeout

    def activity(self) -> str:
        parts = []
        if self.cpu_s >= 0.05:
            parts.append(f"{self.cpu_s:.1f} s CPU")
        if self.io_bytes:
            parts.append(f"{human_bytes(self.io_bytes)} I/O")
        return ", ".join(parts)


@dataclass
class Judgement:
    """The silence judged: ``kind``, the one-line account, and per rank its state."""

    kind: Silence
    line: str
    states: dict[int, RankState] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # the evidence that was missing (unproven)

    @property
    def proven(self) -> bool:
        return self.kind == Silence.HANG


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def ranks_label(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0,2``, ``ranks 1-7``: ``wording.rank_names``, as one range only when the
    ranks are three or more consecutive ones."""
    ordered = sorted(ranks)
    consecutive = len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1))
    return rank_names(ordered, ranges=consecutive)


def _function_of(where: str | None) -> str | None:
    """``save (train.py:88)`` -> ``save (train.py)``: ranks in one function, at other lines, group together."""
    return None if where is None else re.sub(r":\d+\)$", ")", where)


def _working_line(ev: Sequence[RankEvidence], timeout: float, seconds: float, doing: str = "working") -> str:
    """``rank 0 working in save (train.py:88) (progressing: 3.2 s CPU, 1.2 GB I/O)``, grouped by function."""
    by_where: dict[tuple[str | None, bool | None], list[RankEvidence]] = {}
    for e in ev:
        by_where.setdefault((_function_of(e.where), e.progressing(timeout)), []).append(e)
    parts = []
    for (_, progressing), group in by_where.items():
        how = {True: "progressing", False: f"no progress for {seconds:.0f} s", None: "progress not measured"}[
            progressing
        ]
        total = RankEvidence(-1, cpu_s=sum(e.cpu_s for e in group), io_bytes=sum(e.io_bytes for e in group))
        if progressing and total.activity():
            how += f": {total.activity()}" + (" together" if len(group) > 1 else "")
        where = group[0].where
        place = f" in {where}" if where else ""
        parts.append(f"{ranks_label([e.rank for e in group])} {doing}{place} ({how})")
    return "; ".join(parts)


def _waiting_line(ev: Sequence[RankEvidence]) -> str:
    by_what: dict[str, list[int]] = {}
    for e in ev:
        what = e.pending.label() if e.pending is not None else (e.stack_wait or "a collective")
        by_what.setdefault(what, []).append(e.rank)
    return "; ".join(f"{ranks_label(r)} {'wait' if len(r) > 1 else 'waits'} in {what}" for what, r in by_what.items())


def judge(evidence: Sequence[RankEvidence], timeout: float, seconds: float, world: Sequence[int] = ()) -> Judgement:
    """Judge a silence of ``seconds`` (no rank issued or completed a collective) against ``timeout``.

    ``world``: every rank the job should have (ranks without evidence count as unknown)."""
    by_rank = {e.rank: e for e in evidence}
    states = {e.rank: e.state(timeout) for e in evidence}
    for r in world:
        states.setdefault(r, RankState.UNKNOWN)
    waiting = [by_rank[r] for r, s in sorted(states.items()) if s == RankState.WAITING]
    working = [by_rank[r] for r, s in sorted(states.items()) if s == RankState.WORKING]
    unknown = [r for r, s in sorted(states.items()) if s == RankState.UNKNOWN]
    gone = [r for r, s in sorted(states.items()) if s in (RankState.STOPPED, RankState.DEAD)]
    if not waiting:
        if working and all(e.progressing(timeout) is False for e in working) and not unknown:
            line = (
                f"no rank is in a collective; {_working_line(working, timeout, seconds)}: the job makes no "
                "progress, but no rank waits on another (not a collective hang: nothing is stopped)"
            )
            return Judgement(Silence.BUSY, line, states)
        if working:
            line = f"busy: {_working_line(working, timeout, seconds)}; no rank waits in a collective"
            if unknown:
                line += f"; {ranks_label(unknown)}: no evidence"
            return Judgement(Silence.BUSY, line, states)
        missing = (
            [f"{ranks_label(unknown)}: no stack, no completion record, no process state readable"] if unknown else []
        )
        return Judgement(
            Silence.UNPROVEN,
            "no rank is known to wait in a collective" + (f" ({missing[0]})" if missing else ""),
            states,
            missing,
        )
    # The ranks the waiting ones wait for: the other members of their collectives' groups.
    waited: set[int] = set()
    for w in waiting:
        members = w.pending.members if w.pending is not None and w.pending.members else tuple(states)
        waited.update(m for m in members if m != w.rank and states.get(m) != RankState.WAITING)
    for m in waited:
        states.setdefault(m, RankState.UNKNOWN)
    progressing = [
        by_rank[m] for m in sorted(waited) if states[m] == RankState.WORKING and by_rank[m].progressing(timeout)
    ]
    unmeasured = [
        m
        for m in sorted(waited)
        if states[m] == RankState.UNKNOWN
        or (states[m] == RankState.WORKING and by_rank[m].progressing(timeout) is None)
    ]
    head = _waiting_line(waiting)
    if progressing:
        line = f"busy: {_working_line(progressing, timeout, seconds)}, while {head}"
        return Judgement(Silence.BUSY, line, states)
    if unmeasured:
        missing = [
            f"rank {m}: {'no evidence' if states[m] == RankState.UNKNOWN else 'progress not measured'}"
            for m in unmeasured
        ]
        verb = "makes" if len(unmeasured) == 1 else "make"
        line = f"not proven: {head}, but whether {ranks_label(unmeasured)} {verb} progress is not known"
        return Judgement(Silence.UNPROVEN, f"{line} ({'; '.join(missing)})", states, missing)
    # Proven: every waited-for rank waits, does not run, is gone, or works without progress.
    stalled = [by_rank[m] for m in sorted(waited) if states[m] == RankState.WORKING]
    parts = [f"{head} for {seconds:.0f} s"]
    if stalled:
        parts.append(
            f"{_working_line(stalled, timeout, seconds, doing='outside any collective')}: no CPU, no I/O, no new stack"
        )
    for r in gone:
        if r in waited or not waited:
            parts.append(f"rank {r} {states[r].value}")
    if not waited:
        parts.append("every member of the collective is inside it")
    return Judgement(Silence.HANG, "; ".join(parts), states)
