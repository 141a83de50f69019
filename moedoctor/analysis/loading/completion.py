"""Completion of the traced collectives: fused from Flight Recorder dumps, and how much was observed.

``fuse_flight_recorder(run)``: when a run directory holds ``flight_recorder/fr_rank_N`` (PyTorch's
Flight Recorder buffer, written by each rank's recorder at the hang snapshot), the collectives
their trace has no completion for are decided from it (``moedoctor.trace.fr_completion.fuse``):
completed (``RankTrace.completed_by`` names the source, ``flight-recorder-dump``), pending
(``fr_pending``: Flight Recorder shows it scheduled or started), or unknown (``fr_unknown``: older
than the ring buffer, not recorded, or issued after the dump). On NCCL the recorder cannot watch
the ``Work`` of collectives issued without ``async_op`` (torch >= 2.8), so without this a hang on
NCCL reads as if no collective ever completed.

``completion_stats(traces)``: completion observed for X of Y collectives, by source, where Y counts
the collectives something proves finished (observed complete, a later collective of their group
observed complete, or the rank finished cleanly after them). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moedoctor.layout import FLIGHT_RECORDER, RunDir
from moedoctor.trace.fr_completion import SOURCE_FR_DUMP, SOURCE_WORK, entries_from_events, fuse


def fuse_flight_recorder(run) -> None:
    """Fill completions from ``RUN_DIR/flight_recorder`` into ``run.traces`` (a ``RunData`` of a
    run directory); notes what could not be fused in ``run.incomplete``. Never raises."""
    folder = RunDir(run.path).flight_recorder
    if not run.traces or not folder.is_dir():
        return
    try:
        from moedoctor.trace.flight_recorder import is_flight_recorder_dir, read_flight_recorder

        if not is_flight_recorder_dir(folder):
            return
        fr = read_flight_recorder(folder)
    except Exception as e:  # noqa: BLE001 - the traces are still analyzed without it
        run.incomplete.append(
            f"{FLIGHT_RECORDER}/: not read ({type(e).__name__}: {str(e)[:120]}); completion of "
            "collectives whose Work was not observed stays unknown"
        )
        return
    dumps = {t.rank: t for t in fr.traces}
    notes: list[str] = []
    for trace in run.traces:
        dump = dumps.get(trace.rank)
        if dump is None or not dump.events:
            continue
        apply_fusion(trace, fuse(trace.events, entries_from_events(dump.events)), notes)
    run.incomplete.extend(notes)


def apply_fusion(trace, fusion, notes: list[str] | None = None) -> int:
    """Write a ``Fusion`` into one rank's trace; returns how many collectives it completed."""
    if fusion.done:
        for e in trace.events:
            when = fusion.done.get(e.event_id)
            if when is not None and e.completed is None:
                object.__setattr__(e, "completed", when)  # events made by this load, held by no one else
                trace.completed_by[e.event_id] = SOURCE_FR_DUMP
    trace.fr_pending |= fusion.pending
    trace.fr_unknown |= fusion.unknown
    if notes is not None:
        for group, seq in sorted(fusion.misaligned.items()):
            notes.append(
                f"rank {trace.rank}, group {group}: Flight Recorder's collective #{seq} is not the trace's "
                "(the sequence numbers disagree from there: a backend op the recorder does not see, or one "
                f"it counts that Flight Recorder does not); completion from #{seq} on stays unknown"
            )
        for group, seq in sorted(fusion.contradicted.items()):
            notes.append(
                f"rank {trace.rank}, group {group}: Flight Recorder shows #{seq} completed after an earlier "
                "collective it shows pending; not believed (its CUDA event may not have been recorded yet)"
            )
    return len(fusion.done)


def source_of(trace, event) -> str | None:
    """Who proved the collective complete: ``work``, ``flight-recorder``, ``flight-recorder-dump``;
    None when it was not seen completing."""
    if event.completed is None:
        return None
    return trace.completed_by.get(event.event_id, SOURCE_WORK)


@dataclass
class CompletionStats:
    """Completion observed for ``observed`` of ``provable`` collectives (and p2p ops), by source."""

    observed: int = 0
    provable: int = 0
    events: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    pending: int = 0  # Flight Recorder showed them issued and not completed
    unknown: int = 0  # neither observed nor decided
    p2p: int = 0  # send/recv ops among ``events``
    p2p_observed: int = 0  # of which seen completing

    def fraction(self) -> float | None:
        return self.observed / self.provable if self.provable else None

    def sentence(self) -> str:
        sources = ", ".join(f"{k} {v}" for k, v in sorted(self.by_source.items(), key=lambda kv: -kv[1])) or "none"
        text = f"completion observed for {self.observed} of {self.provable} collectives (source: {sources})"
        unseen = self.p2p - self.p2p_observed
        if unseen:
            # On NCCL a send/recv inside batch_isend_irecv gets a null Work; the recorder decides it from a
            # full Flight Recorder dump at its last poll, while the ring buffer can still match it. Where
            # neither told, no completion is not evidence that it did not complete.
            text += (
                f"; p2p completion unknown for {unseen} of {self.p2p} send/recv ops (neither their Work nor "
                "Flight Recorder reported it: whether they completed is not known, not that they did not)"
            )
        return text

    def to_dict(self, windowed: bool = False) -> dict:
        """``windowed``: the traces were loaded only around the divergence (large runs), and so
        are these counts."""
        return {
            "observed": self.observed,
            "provable": self.provable,
            "events": self.events,
            "fraction": None if self.fraction() is None else round(self.fraction(), 4),
            "by_source": dict(sorted(self.by_source.items())),
            "pending": self.pending,
            "unknown": self.unknown,
            "p2p": {"events": self.p2p, "observed": self.p2p_observed, "unknown": self.p2p - self.p2p_observed},
            "scope": "windows" if windowed else "all",
            "summary": self.sentence() + (" (in the windows loaded around the divergence)" if windowed else ""),
        }


def completion_stats(traces) -> CompletionStats:
    """Over every rank's collectives: which were seen completing and by whom, and how many a later
    record proves finished (the denominator): observed ones, the collectives before a completed one
    of the same group (one group's collectives complete in order), and everything a rank issued
    before it finished cleanly (its final coverage record, written at ``destroy_process_group`` or
    exit)."""
    stats = CompletionStats()
    for trace in traces:
        finished = any(c.reason in ("destroy", "exit") for c in trace.coverage)
        latest_done: dict[str, int] = {}
        for e in trace.events:
            if e.completed is not None and not e.is_p2p:
                latest_done[e.group.name] = max(e.seq, latest_done.get(e.group.name, 0))
        for e in trace.events:
            stats.events += 1
            stats.p2p += e.is_p2p
            source = source_of(trace, e)
            if source is not None:
                stats.p2p_observed += e.is_p2p
                stats.observed += 1
                stats.provable += 1
                stats.by_source[source] = stats.by_source.get(source, 0) + 1
                continue
            if finished or (not e.is_p2p and e.seq < latest_done.get(e.group.name, 0)):
                stats.provable += 1
            if e.event_id in trace.fr_pending:
                stats.pending += 1
            else:
                stats.unknown += 1
    return stats
