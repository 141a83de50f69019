"""``RunView``: indexes over a ``RunData`` that the matching, the culprit rules and the patterns share.

Everything is keyed by rank, group name and sequence number, never by the order the trace files
were listed or read, so no finding depends on file order.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property

from moedoctor.analysis.loading.run_data import RunData
from moedoctor.analysis.model import GroupRef
from moedoctor.events import CollectiveEvent, Evidence, Phase, RankException, TracebackFrame
from moedoctor.process_state import ProcessState
from moedoctor.run_records import BusyRecord, Frame, StackDump, is_distributed_frame, is_own_frame
from moedoctor.wording import phase_label

#: Frames of libraries, for the job's own frame of a traceback.
_LIBRARY_MARKERS = ("/torch/", "<frozen", "<string>")


def user_frame(exc: RankException) -> TracebackFrame | None:
    """The job's innermost frame of an exception's traceback: outside torch, moedoctor and the
    standard library (installed packages count as the job's, as for call sites); None: only those."""
    for f in reversed(exc.frames):
        path = f.file.replace("\\", "/")
        stdlib = "/lib/python3" in path and "site-packages" not in path
        if not stdlib and not any(m in path for m in _LIBRARY_MARKERS) and not is_own_frame(path):
            return f
    return None


class RunView:
    def __init__(self, run: RunData):
        self.run = run
        self.traces = run.trace_of
        self.ranks = sorted(self.traces)
        self.groups: dict[str, GroupRef] = {}
        self.conflicts: list[str] = []
        self._by_seq: dict[str, dict[int, dict[int, CollectiveEvent]]] = defaultdict(lambda: defaultdict(dict))
        self._p2p: dict[str, dict[int, dict[int, dict[int, CollectiveEvent]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(dict))
        )
        self.last_event: dict[int, CollectiveEvent | None] = {}
        for rank in self.ranks:
            trace = self.traces[rank]
            last = None
            for e in trace.events:
                self._define(e.group.name, e.group.desc, e.group.ranks)
                if e.is_p2p:
                    if e.peer is not None and e.p2p_seq is not None:
                        self._p2p[e.group.name][rank][e.peer].setdefault(e.p2p_seq, e)
                else:
                    self._by_seq[e.group.name][rank].setdefault(e.seq, e)
                if last is None or e.event_id > last.event_id:
                    last = e
            for g in trace.groups.values():
                self._define(g.name, g.desc, g.ranks)
            self.last_event[rank] = last

    def _define(self, name: str, desc: str, ranks: tuple[int, ...]) -> None:
        known = self.groups.get(name)
        if known is None:
            self.groups[name] = GroupRef(name, desc, tuple(ranks))
        elif known.ranks != tuple(ranks) and len(self.conflicts) < 5:
            self.conflicts.append(
                f"group {name}: ranks disagree on its members ({list(known.ranks)} and "
                f"{list(ranks)}); the first seen is used"
            )
            self.groups[name] = GroupRef(name, desc, tuple(known.ranks))

    # ---- per group ------------------------------------------------------------------------------

    def traced_members(self, group: str) -> list[int]:
        return [r for r in self.groups[group].ranks if r in self.traces]

    def untraced_members(self, group: str) -> list[int]:
        return [r for r in self.groups[group].ranks if r not in self.traces]

    def last_seq(self, rank: int, group: str) -> int:
        """The last collective this rank issued on this group (0: none)."""
        return self.run.last_seq.get(rank, {}).get(group, 0)

    def last_p2p(self, rank: int, group: str, peer: int) -> int:
        return self.run.last_p2p.get(rank, {}).get((group, peer), 0)

    def never_reached(self, rank: int, group: str, seq: int) -> bool:
        """True when ``rank`` certainly never issued collective ``seq`` of ``group``."""
        return rank in self.traces and rank not in self.run.open_ended and self.last_seq(rank, group) < seq

    def event(self, rank: int, group: str, seq: int) -> CollectiveEvent | None:
        return self._by_seq.get(group, {}).get(rank, {}).get(seq)

    def seq_map(self, rank: int, group: str) -> dict[int, CollectiveEvent]:
        return self._by_seq.get(group, {}).get(rank, {})

    def seqs(self, group: str) -> list[int]:
        """Every sequence number of the group with an event on some rank, ascending."""
        out: set[int] = set()
        for events in self._by_seq.get(group, {}).values():
            out.update(events)
        return sorted(out)

    def events(self, rank: int, group: str, before: int | None = None) -> list[CollectiveEvent]:
        """The rank's collectives on the group in sequence order (those before ``before`` only)."""
        events = self.seq_map(rank, group)
        return [events[s] for s in sorted(events) if before is None or s < before]

    def issued_from(self, rank: int, group: str, site: str, before: int | None = None) -> bool:
        """Whether the rank issued any collective on the group from call site ``site`` (``file:line``,
        ``CallSite.where``), before seq ``before`` when given."""
        return any(e.call_site is not None and e.call_site.where == site for e in self.events(rank, group, before))

    def p2p_peers(self, group: str) -> dict[int, dict[int, dict[int, CollectiveEvent]]]:
        return self._p2p.get(group, {})

    def rank_events(self, rank: int) -> list[CollectiveEvent]:
        return self.traces[rank].events if rank in self.traces else []

    @cached_property
    def collective_count(self) -> int:
        return sum(len(t.events) for t in self.traces.values())

    # ---- evidence, stacks, exits ----------------------------------------------------------------

    def evidence(self, rank: int, kind: str | None = None, step: int | None = None) -> list[Evidence]:
        trace = self.traces.get(rank)
        if trace is None:
            return []
        return [e for e in trace.evidence if (kind is None or e.kind == kind) and (step is None or e.step == step)]

    def discarded_steps(self, rank: int) -> list[Evidence]:
        """The ``zero_grad`` records that cleared gradients a backward pass had produced without an
        ``optimizer.step`` in between: each one is a step whose gradients the rank threw away (the
        recorder's optimizer and ``zero_grad`` hooks; a micro-batch loop never clears between its
        backward passes, a stepping rank steps before it clears). None when the rank did that in a
        step it then completed: that code clears between micro-batches by design."""
        found, pending, stepped = [], False, set()
        for e in self.evidence(rank):
            if e.kind == "backward_end":
                pending = True
            elif e.kind == "optimizer_step_begin":
                pending = False
                stepped.add(e.step)
            elif e.kind == "zero_grad" and pending:
                found.append(e)
                pending = False
        # Code that clears gradients between its own micro-batches (it reduces and accumulates them
        # itself) does so in the steps it completed too: a clear like those of a completed step is
        # this code's habit, not a thrown-away step. Only a step before the last clear counts: a rank
        # that skips a step keeps its step counter, so its next iteration completes that same step.
        last = max((e.step for e in found), default=None)
        habit = {e.step for e in found if e.step in stepped and e.step != last}
        return [] if habit else found

    def discarded_in(self, rank: int, step: int) -> bool:
        """Did the rank throw away the gradients of step ``step`` (``discarded_steps``)?"""
        return any(e.step == step for e in self.discarded_steps(rank))

    def stepped(self, rank: int, step: int) -> bool:
        """Whether the rank began ``optimizer.step`` while its step counter was ``step``."""
        return bool(self.evidence(rank, "optimizer_step_begin", step))

    def nonfinite_loss(self, rank: int, step: int) -> list[Evidence]:
        return [
            e for e in self.evidence(rank, "loss", step) if str(e.data.get("value")).lower() in ("inf", "-inf", "nan")
        ]

    def stack(self, rank: int) -> StackDump | None:
        return self.run.stacks.get(rank)

    def stack_frame(self, rank: int) -> Frame | None:
        """Where the rank's main thread was: its innermost frame outside libraries, else the innermost."""
        dump = self.stack(rank)
        if dump is None or not dump.main_thread:
            return None
        return dump.user_frame or dump.main_thread[0]

    def in_distributed(self, rank: int) -> bool | None:
        """Whether the rank's main thread waits inside torch.distributed (None: no stack)."""
        dump = self.stack(rank)
        if dump is None or not dump.main_thread:
            return None
        return any(is_distributed_frame(f) for f in dump.main_thread[:6])

    def process(self, rank: int) -> ProcessState | None:
        """The rank's process state read from /proc when the hang was diagnosed (None: not recorded)."""
        dump = self.stack(rank)
        return None if dump is None else dump.process

    def frozen(self, rank: int) -> str | None:
        """``T``/``t`` (stopped) or ``D`` (uninterruptible) when every reading of the rank's process
        state said it does not run; None otherwise or when not recorded."""
        state = self.process(rank)
        return None if state is None else state.frozen

    @cached_property
    def frozen_ranks(self) -> dict[int, ProcessState]:
        """Every rank whose process did not run when the hang was diagnosed, with its state."""
        return {
            r: d.process
            for r, d in sorted(self.run.stacks.items())
            if d.process is not None and d.process.frozen and not self.died(r)
        }

    def exception(self, rank: int) -> RankException | None:
        """The first exception nothing caught in the rank (its ``x`` record; None: none recorded)."""
        trace = self.traces.get(rank)
        return trace.exceptions[0] if trace is not None and trace.exceptions else None

    def exception_line(self, rank: int) -> str | None:
        """``rank 1 raised torch.utils.checkpoint.CheckpointError at train.py:109 (main) in backward of
        step 2 (raised in checkpoint.py:879 check_recomputed_tensors_match): <its first line>``, from
        its ``x`` record; None when none was recorded."""
        exc = self.exception(rank)
        if exc is None:
            return None
        site = user_frame(exc)
        inner = exc.frames[-1] if exc.frames else None
        at = f" at {site.short} ({site.function})" if site is not None else ""
        raised_in = f" (raised in {inner.short} {inner.function})" if inner is not None and inner != site else ""
        lines = exc.message.strip().splitlines()
        first = lines[0][:200] if lines else ""
        phase = phase_label(exc.phase.value)
        return f"rank {rank} raised {exc.type}{at} in {phase} of step {exc.step}{raised_in}: {first}"

    def exit_code(self, rank: int) -> int | None:
        m = self.run.manifest
        if m is None or rank not in m.exits:
            return None
        return m.exits[rank].exit_code

    def first_failure(self, rank: int) -> bool:
        """The launcher (torchrun) named this rank's failure its root cause: it failed before the
        launcher stopped the others."""
        m = self.run.manifest
        return m is not None and rank in m.exits and bool(m.exits[rank].first_failure)

    def busy_records(self) -> list[BusyRecord]:
        """The silences of the collectives ``moedoctor run`` judged busy or unproven while the job
        ran (its manifest's ``busy``), oldest first: each rank's state then, and how long it lasted."""
        m = self.run.manifest
        return list(m.busy) if m is not None else []

    def died(self, rank: int) -> bool:
        """The rank's process ended with a failure of its own (not stopped by moedoctor)."""
        m = self.run.manifest
        if m is None or rank not in m.exits:
            return False
        e = m.exits[rank]
        return e.source != "stopped" and e.exit_code not in (None, 0)

    def finished(self, rank: int) -> bool:
        """The rank's process ended normally: exit 0, or, where the manifest has no exit status for
        it, it wrote its final coverage record (``destroy_process_group`` or interpreter exit). A
        rank that raised also exits the interpreter: its non-zero status says it did not finish."""
        m = self.run.manifest
        if m is not None and rank in m.exits and m.exits[rank].exit_code is not None:
            return m.exits[rank].exit_code == 0
        trace = self.traces.get(rank)
        return trace is not None and any(c.reason in ("destroy", "exit") for c in trace.coverage)

    @property
    def hang_declared(self) -> bool:
        return self.run.manifest is not None and self.run.manifest.hang is not None

    @property
    def finished_cleanly(self) -> bool:
        """Every rank of the run exited 0 (manifest), or every traced rank wrote its final coverage."""
        m = self.run.manifest
        if m is not None and m.exits:
            return m.hang is None and all(e.exit_code == 0 for e in m.exits.values())
        return bool(self.traces) and all(
            any(c.reason in ("destroy", "exit") for c in t.coverage) for t in self.traces.values()
        )

    def completion_tracked(self, rank: int) -> bool:
        """Whether this rank's trace records completions at all (Gloo Flight Recorder dumps do not)."""
        return any(e.completed is not None for e in self.rank_events(rank))

    def completion_observed(self, rank: int, group: str, seq: int) -> bool:
        """Whether an incomplete collective ``seq`` of ``group`` on this rank really did not
        complete, as far as the trace can tell: the recorder observes completions there (the op is
        not a functional collective, and an earlier collective of the group, or else of any group,
        was seen completing on this rank). False: its completion was simply not observed (NCCL
        works the recorder could not watch, Flight Recorder dumps without states). Where the run's
        Flight Recorder dumps show the collective pending, that is known too."""
        e = self.event(rank, group, seq)
        trace = self.traces.get(rank)
        if e is not None and trace is not None:
            if e.event_id in trace.fr_pending:
                return True  # Flight Recorder shows it scheduled or started, not completed
            if e.event_id in trace.fr_unknown:
                return False  # Flight Recorder could not tell
        if e is not None and e.raw_op.startswith("_c10d_functional"):
            return False
        earlier = [x for s, x in self.seq_map(rank, group).items() if s < seq]
        if earlier:
            return any(x.completed is not None for x in earlier)
        return self.completion_tracked(rank)

    def phase_of(self, rank: int, group: str, seq: int) -> Phase | None:
        e = self.event(rank, group, seq)
        return None if e is None else e.phase

    def completion_source(self, rank: int, event: CollectiveEvent) -> str | None:
        """Who proved ``event`` complete: ``work`` (the recorder watched its Work, or a later
        collective of its group), ``flight-recorder`` (the recorder read PyTorch's Flight Recorder
        while the job ran), ``flight-recorder-dump`` (this analysis, from the dumps written at the
        hang); None when it was not seen completing."""
        trace = self.traces.get(rank)
        if trace is None or event.completed is None:
            return None
        return trace.completed_by.get(event.event_id, "work")

    def completion_note(self, rank: int, event: CollectiveEvent | None) -> str:
        """`` (completion from Flight Recorder)`` where that is where the evidence comes from;
        `` (Flight Recorder shows it pending)`` where Flight Recorder shows it not completed."""
        if event is None:
            return ""
        source = self.completion_source(rank, event)
        if source is not None and source.startswith("flight-recorder"):
            return " (completion from Flight Recorder)"
        trace = self.traces.get(rank)
        if source is None and trace is not None and event.event_id in trace.fr_pending:
            return " (Flight Recorder shows it pending)"
        return ""
