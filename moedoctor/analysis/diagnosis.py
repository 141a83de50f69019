"""``analyze(run) -> Report``: from traces, stacks and the manifest to a verdict with its evidence.

1. Per group, the first sequence number where the ranks differ (``matching``), p2p per peer pair.
2. The wait-for graph across groups and its cycles (``waitfor``).
3. The primary divergence: a wait-for cycle first, then the earliest mismatch, then ranks missing
   from a collective the others wait in, then (when the job hangs) a group stalled inside one
   collective.
4. The culprits (``culprits``) and the pattern (``patterns``), best score wins, ties unknown.
5. The verdict, a one-sentence summary, the fix and the ``moedoctor verify`` command, and the rows
   around the divergence for the side-by-side table.
"""

from __future__ import annotations

import linecache
from dataclasses import replace
from collections.abc import Sequence
import signal

from moedoctor.analysis.loading.completion import completion_stats
from moedoctor.analysis.mechanisms.culprits import Culprits, find_culprits
from moedoctor.analysis.patterns import missing as missing_evidence
from moedoctor.analysis.from_stacks import report_from_stacks
from moedoctor.analysis.loading.run_data import RunData, SourceKind
from moedoctor.analysis.matching import all_divergences, stalled
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding
from moedoctor.analysis.mechanisms.detection import mechanism_of
from moedoctor.analysis.mechanisms.wording import suggestion as mechanism_suggestion
from moedoctor.analysis.model import (
    AlignedRow,
    Candidate,
    Divergence,
    DivergenceKind,
    OpView,
    RankSummary,
    Report,
    Suggestion,
    Verdict,
    WaitEdge,
)
from moedoctor.analysis.patterns import THRESHOLD, TIE, by_id, classify_all
from moedoctor.analysis.patterns.base import Context, Finding, Pattern, names
from moedoctor.analysis.patterns.not_a_desync import not_established
from moedoctor.analysis.patterns.rank_stopped import stopped_line, waits_in
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.evidence.timing import slow_report, storm_fix_config
from moedoctor.analysis.mechanisms.waitfor import chain_roots, find_cycle, roots, wait_edges
from moedoctor.process_state import FROZEN_STATES

#: Rows shown before and after the divergence in the side-by-side table.
ROWS_BEFORE, ROWS_AFTER = 4, 2
#: Rank columns shown at most.
MAX_COLUMNS = 6
#: Exceptions of two ranks closer than this (seconds) count as raised together.
_SAME_MOMENT = 0.05


def analyze(run: RunData) -> Report:
    if not run.traces and any(d.error is None for d in run.stacks.values()):
        # Nothing was recorded (the job hung before its first process group, or the recorder did not
        # load): the stacks are the evidence, as for a job triaged from outside.
        return report_from_stacks(
            run.stacks, source=str(run.path), world_size=run.world_size, gpus=run.gpus, incomplete=run.incomplete
        )
    view = RunView(run)
    incomplete = list(dict.fromkeys(run.incomplete + view.conflicts))
    divs = all_divergences(view)
    edges = wait_edges(view)
    cycle = find_cycle(edges)
    hang = _hang(view, edges)
    if view.finished_cleanly:
        for d in [d for d in divs if d.kind == DivergenceKind.MISSING or d.missing]:
            incomplete.append(
                f"group {d.group.name}: {names(d.missing)}'s trace ends before #{d.seq} although the "
                "job finished cleanly (trace cut short)"
            )
            divs.remove(d)
    interrupted = view.run.manifest is not None and view.run.manifest.interrupted
    if interrupted:
        incomplete.insert(0, view.run.manifest.interruption())
    if _in_flight_at_interrupt(view, divs, cycle):
        # The run was interrupted (Ctrl-C, or its supervisor killed) while every rank was still issuing
        # collectives: a rank a few collectives ahead (a broadcast's root runs ahead of its receivers),
        # or every rank inside the collective it was in at that moment, is the moment of the stop, not a
        # desync nor a hang.
        for d in divs:
            incomplete.append(
                f"group {d.group.name}: {names(d.missing)}'s trace ends before #{d.seq}: the run was interrupted "
                "while every rank was still issuing collectives (in flight at the stop, not a desync)"
            )
        stopped_groups = {d.group.name for d in divs}
        divs = []
        edges = [e for e in edges if e.group not in stopped_groups]
        hang = bool(edges)
    primary = _primary(view, divs, edges, cycle, hang)
    culprits = find_culprits(view, primary, edges, cycle)
    ctx = Context(view, primary, culprits, edges, cycle, hang)
    died = sorted(r for r in _all_ranks(view) if view.died(r))
    mechanism = mechanism_of(view, primary, culprits, edges, cycle)
    not_named: dict[str, list[str]] = {}

    pattern, finding, candidates = _choose(ctx, died, mechanism, not_named)
    culprit_ranks = list(culprits.ranks)
    reasoning = culprits.reasoning
    named = pattern is not None and pattern.id != "unknown-desync"
    if finding is not None and finding.culprits and (named or not culprit_ranks):
        # A named pattern knows which side made the decision (the rank that skipped its step, ran fewer
        # micro-batches, issued the extra collective); the generic rules only see who is waiting.
        if sorted(finding.culprits) != culprit_ranks:
            culprit_ranks = sorted(finding.culprits)
            reasoning = f"{names(culprit_ranks)}: named by the {pattern.id} evidence"
    if (
        not named
        and mechanism is not None
        and mechanism.mechanism in (Mechanism.SKIPPED_COLLECTIVE, Mechanism.EXTRA_COLLECTIVE, Mechanism.LOOP_TRIP_COUNT)
        and mechanism.ranks
        and sorted(mechanism.ranks) != culprit_ranks
    ):
        # No pattern named: the mechanism's reading of the earlier steps says which side left out or
        # added the collective, or left the loop after fewer iterations (the vocabulary's culprits),
        # where the generic rules only see who waits or who is fewer.
        culprit_ranks = sorted(mechanism.ranks)
        if mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT:
            reasoning = f"{names(culprit_ranks)} left the loop after fewer iterations ({mechanism.mechanism.value})"
        else:
            did = "left out" if mechanism.mechanism == Mechanism.SKIPPED_COLLECTIVE else "issued"
            reasoning = f"{names(culprit_ranks)} {did} the collective the others did not ({mechanism.mechanism.value})"
    if not culprit_ranks and primary is None and died:
        culprit_ranks = _first_deaths(view, died)
        reasoning = f"{names(culprit_ranks)} died; no collective divergence was recorded before"

    verdict = _verdict(view, pattern, primary, hang, died)
    if verdict == Verdict.HEALTHY:
        pattern = finding = None
        culprit_ranks, reasoning = [], "no divergence between ranks"
        if interrupted:  # nothing wrong up to the stop, but the run did not end: no verdict on the job
            verdict = Verdict.INTERRUPTED
    evidence = list(finding.evidence) if finding else []
    if verdict == Verdict.HEALTHY:
        mechanism, not_named = None, {}
    if mechanism is not None:
        stopped = {c.pattern for c in candidates if c.score >= THRESHOLD}  # those the declarations held back
        evidence.extend(f"{p} not named: it needs {'; '.join(m)}" for p, m in not_named.items() if p in stopped)
    if pattern is None and verdict != Verdict.HEALTHY and candidates:
        # Nothing named: what the best candidate saw and could not establish, then the others.
        evidence.extend(candidates[0].evidence)
        evidence.extend(f"candidate {c.pattern} ({c.score:.2f}): {'; '.join(c.evidence)}" for c in candidates[1:])
    if verdict != Verdict.HEALTHY and (pattern is None or pattern.id != "rank-stopped"):
        evidence.extend(stopped_line(view, r, state) for r, state in list(view.frozen_ranks.items())[:8])
    evidence.extend(e for e in _death_evidence(view, died) if e not in evidence)
    if verdict != Verdict.HEALTHY:
        evidence.extend(_shared_gpus(view))
    if pattern is not None and pattern.id == "unknown-desync" and len(candidates) > 1:
        evidence.extend(
            f"candidate {c.pattern} ({c.score:.2f}): {'; '.join(c.evidence)}"
            for c in candidates
            if c.pattern != "unknown-desync"
        )
    fixes = list(pattern.fixes) if pattern else []
    slow = slow_report(run.traces)
    storm_fix = storm_fix_config(slow, run.manifest.command if run.manifest else None) if not fixes else None
    if storm_fix is not None:  # nothing else to fix: offer to coalesce the storm's broadcasts
        fixes = list(storm_fix)
    fix_config = finding.fix_config if finding is not None and fixes else None
    if storm_fix is not None:
        fix_config = storm_fix
    verify = f"moedoctor verify --fix {fixes[0]} --run {run.path}" if fixes else None
    suggestion = _suggestion(pattern, finding, primary, culprit_ranks) if pattern else None
    summary = _summary(view, verdict, pattern, primary, culprit_ranks, cycle, died, finding, candidates)
    if mechanism is not None and (pattern is None or pattern.id == "unknown-desync"):
        # No pattern has the evidence it needs: the mechanism is the diagnosis, and its own fix.
        suggestion = _suggestion(
            by_id("unknown-desync"), Finding(0.0, (), suggestion=mechanism_suggestion(mechanism)), None, []
        )
        summary = f"{summary} Mechanism: {mechanism.mechanism.value} ({mechanism_suggestion(mechanism).text})."
    report = Report(
        source=str(run.path),
        source_kind=run.kind,
        verdict=verdict,
        summary=summary,
        pattern=pattern.id if pattern else None,
        pattern_title=pattern.title if pattern else None,
        culprit_ranks=culprit_ranks,
        culprit_reasoning=reasoning,
        divergence=primary,
        wait_for=edges,
        cycle=cycle,
        evidence=evidence,
        candidates=candidates,
        fixes=fixes,
        verify_command=verify,
        suggestion=suggestion,
        fix_config=fix_config,
        groups=divs,
        ranks=_rank_summaries(view),
        alignment=_alignment(view, primary, culprit_ranks)[0],
        alignment_ranks=_alignment(view, primary, culprit_ranks)[1],
        incomplete=incomplete,
        world_size=run.world_size,
        traced_ranks=view.ranks,
        collectives=_collective_count(run),
        completion=completion_stats(run.traces).to_dict(windowed=run.windowed),
        slow=slow,
        busy=list(run.manifest.busy) if run.manifest is not None else [],
        mechanism=mechanism,
        not_named=not_named,
    )
    busy = _busy_at_end(run)
    if busy is not None and not died:
        line, working = busy
        if report.verdict == Verdict.INTERRUPTED:  # no verdict on the job, but what it was doing then
            return replace(
                report,
                summary=f"{report.summary} When it was stopped, the job was busy, not stuck: "
                f"{line.removeprefix('busy: ')}.",
            )
        if report.verdict == Verdict.STUCK and report.pattern in (None, "straggler"):
            return slow_not_stuck(report, line)
        if primary is not None and primary.kind == DivergenceKind.MISSING and set(primary.missing) <= working:
            # The ranks that "never issued" it were working when the run was stopped: on their way.
            return slow_not_stuck(report, line)
    return report


def _busy_at_end(run: RunData) -> tuple[str, set[int]] | None:
    """The run ended in a silence ``moedoctor run`` judged busy: stopped by ``--max-busy``, or
    stopped by someone else (Ctrl-C, a kill, even of moedoctor) while it lasted. Its account and the
    ranks that were working then, else None."""
    m = run.manifest
    if m is None or not m.busy:
        return None
    last = m.busy[-1]
    working = {int(r) for r, state in last.states.items() if state == "working"}
    if m.hang is not None and m.hang.trigger == "max-busy" and m.hang.proof and "busy:" in m.hang.proof:
        return m.hang.proof[m.hang.proof.index("busy:") :], working
    if m.hang is None and not last.ended and last.kind == "busy" and m.status != "finished":
        return last.line, working
    return None


def slow_not_stuck(report: Report, busy: str) -> Report:
    """A stalled job whose waited-for ranks were working and progressing: slow, not a straggler hang
    (``moedoctor.rank_states``). The report says which ranks worked where; no pattern, no fix."""
    account = busy.removeprefix("busy: ")
    return replace(
        report,
        verdict=Verdict.SLOW,
        summary=f"Slow, not stuck: {account}.",
        pattern=None,
        pattern_title=None,
        culprit_ranks=[],
        culprit_reasoning="the ranks the others waited for were working and making progress (CPU, I/O, new stacks)",
        evidence=[f"busy: {account}"] + [e for e in report.evidence if e != busy],
        fixes=[],
        verify_command=None,
        suggestion=None,
        fix_config=None,
    )


# ---- what happened ------------------------------------------------------------------------------

#: Ranks whose last collectives are this close (seconds) were all progressing when the run was stopped.
IN_FLIGHT_SECONDS = 1.0


def _in_flight_at_interrupt(view: RunView, divs: list[Divergence], cycle: list[WaitEdge] | None) -> bool:
    """The run was interrupted (``ManifestInfo.interrupted``: Ctrl-C, or its supervisor killed; no
    hang declared) while every rank was still issuing collectives: no mismatch or cycle anywhere, and
    every rank's last collective within ``IN_FLIGHT_SECONDS`` of the latest one (a stuck rank's is
    older). Its ragged trace ends (``missing`` divergences) and the collectives the ranks were in at
    that moment are the stop, not a desync or a hang (none lasted the hang timeout: none was declared)."""
    m = view.run.manifest
    if m is None or not m.interrupted or cycle:
        return False
    if any(d.kind != DivergenceKind.MISSING for d in divs):
        return False
    last = [e.time for e in view.last_event.values() if e is not None]
    return bool(last) and len(last) == len(view.ranks) and max(last) - min(last) <= IN_FLIGHT_SECONDS


def _hang(view: RunView, edges: list[WaitEdge]) -> bool:
    if view.hang_declared:
        return True
    if view.finished_cleanly:
        return False
    if edges:
        return True
    return any(
        view.last_event[r] is not None and view.last_event[r].completed is None and view.completion_tracked(r)
        for r in view.ranks
    )


def _primary(
    view: RunView, divs: list[Divergence], edges: list[WaitEdge], cycle: list[WaitEdge] | None, hang: bool
) -> Divergence | None:
    if cycle:
        groups = [e.group for e in cycle]
        found = [d for d in divs if d.group.name in groups]
        if found:
            return min(found, key=lambda d: (groups.index(d.group.name), d.earliest))
    mismatches = [
        d
        for d in divs
        if d.kind in (DivergenceKind.MISMATCH, DivergenceKind.CONTRACT)
        or (d.kind == DivergenceKind.P2P and not d.missing)
    ]
    if mismatches:
        return min(mismatches, key=lambda d: (d.earliest, d.group.name))
    missing = [d for d in divs if d.missing]
    if missing:
        root_set = set(roots(edges))
        return min(missing, key=lambda d: (not set(chain_roots(edges, d.missing)) & root_set, d.earliest, d.group.name))
    if hang:
        stuck = [s for s in (stalled(view, g) for g in sorted(view.groups)) if s is not None]
        if stuck:
            return min(stuck, key=lambda d: (-len(d.per_rank), d.earliest, d.group.name))
    return None


#: Patterns proven by the collectives alone (ops, shapes, order), without phases or evidence.
STRUCTURAL_PATTERNS = frozenset({"shape-mismatch", "collective-order-inversion", "not-a-desync"})


def _admitted(
    ranked: list[tuple[Pattern, Finding]],
    ctx: Context,
    mechanism: MechanismFinding | None,
    not_named: dict[str, list[str]],
) -> list[tuple[Pattern, Finding]]:
    """The findings whose pattern's declaration admits them (each pattern module's ``DECLARATION``): the mechanism
    is one it refines and its required evidence is present. The others are recorded in ``not_named``
    with what they lacked."""
    if mechanism is None:
        return ranked
    kept = []
    for p, f in ranked:
        lacks = missing_evidence(p.id, ctx, mechanism)
        if lacks:
            not_named[p.id] = lacks
        else:
            kept.append((p, f))
    return kept


def _choose(
    ctx: Context,
    died: list[int],
    mechanism: MechanismFinding | None = None,
    not_named: dict[str, list[str]] | None = None,
) -> tuple[Pattern | None, Finding | None, list[Candidate]]:
    not_named = {} if not_named is None else not_named
    div = ctx.div
    if (
        div is not None
        and div.kind == DivergenceKind.MISSING
        and ctx.culprits.ranks
        and all(ctx.view.died(r) for r in ctx.culprits.ranks)
    ):
        # The ranks the others wait for died: a crash, not a desync pattern, unless a pattern's own
        # evidence says why they stopped issuing collectives before they died.
        explained = [(p, f) for p, f in classify_all(ctx) if f.explains_crash and f.score >= THRESHOLD]
        explained = _admitted(explained, ctx, mechanism, not_named)
        if explained:
            return explained[0][0], explained[0][1], [Candidate(p.id, f.score, f.evidence) for p, f in explained]
        return None, None, []
    ranked = classify_all(ctx)
    candidates = [Candidate(p.id, f.score, f.evidence) for p, f in ranked]
    named = [(p, f) for p, f in ranked if p.id != "unknown-desync" and f.score >= THRESHOLD]
    named = _admitted(named, ctx, mechanism, not_named)
    # Every other candidate's missing evidence too, for the report's not_named.
    _admitted(
        [(p, f) for p, f in ranked if p.id != "unknown-desync" and f.score < THRESHOLD], ctx, mechanism, not_named
    )
    if ctx.view.run.kind == SourceKind.FLIGHT_RECORDER:
        # A Flight Recorder dump has no phases, steps or evidence: only patterns that the
        # collectives' own structure proves may be named; the others stay candidates.
        named = [(p, f) for p, f in named if p.id in STRUCTURAL_PATTERNS]
    if named and (len(named) == 1 or named[0][1].score - named[1][1].score >= TIE):
        return named[0][0], named[0][1], candidates
    if ctx.desync_kind():
        fallback = next(((p, f) for p, f in ranked if p.id == "unknown-desync"), None)
        if fallback is None:
            return by_id("unknown-desync"), Finding(0.0, ()), candidates
        return fallback[0], fallback[1], candidates
    if named:  # a tie between patterns that are not desyncs: name neither
        return None, None, candidates
    return None, None, candidates


def _verdict(view: RunView, pattern: Pattern | None, div: Divergence | None, hang: bool, died: list[int]) -> Verdict:
    if died:
        return Verdict.CRASHED
    if pattern is not None and pattern.desync:
        return Verdict.DESYNC
    if pattern is not None or hang:
        return Verdict.STUCK
    if div is not None and div.kind == DivergenceKind.MISMATCH:
        return Verdict.DESYNC
    return Verdict.HEALTHY


def _all_ranks(view: RunView) -> list[int]:
    ranks = set(view.ranks) | set(view.run.stacks)
    if view.run.manifest is not None:
        ranks |= set(view.run.manifest.exits)
    return sorted(ranks)


def _signal_name(code: int) -> str | None:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return None


def _first_deaths(view: RunView, died: list[int]) -> list[int]:
    """The ranks that died first, as far as the exit statuses tell: a signal other than the
    SIGTERM/SIGKILL a launcher sends when tearing the job down, else every rank that died."""
    teardown = (signal.SIGTERM, signal.SIGKILL)
    own = [r for r in died if (view.exit_code(r) or 0) < 0 and -view.exit_code(r) not in teardown]
    if own:
        return own
    outside = _killed_from_outside(view, died)
    if outside:
        return outside
    # No signal of its own: the rank whose recorded exception came first raised it first (the others'
    # exceptions, "connection closed by peer", follow from it).
    raised = {r: exc.time for r in died if (exc := view.exception(r)) is not None}
    if raised:
        first = min(raised.values())
        return [r for r, t in raised.items() if t - first < _SAME_MOMENT]
    return died


def _killed_from_outside(view: RunView, died: list[int]) -> list[int]:
    """The rank killed by SIGTERM or SIGKILL before the launcher stopped the others: the one torchrun
    names as its root cause ("first observed failure") while it died of such a signal, which the
    launcher sends only after a failure. Several such ranks (nodes that each name one): none."""
    found = [r for r in died if view.first_failure(r) and -(view.exit_code(r) or 0) in (signal.SIGTERM, signal.SIGKILL)]
    return found if len(found) == 1 else []


def _death_evidence(view: RunView, died: list[int]) -> list[str]:
    out = []
    outside = _killed_from_outside(view, died)
    for r in died:
        code = view.exit_code(r)
        sig = _signal_name(code)
        if sig == "SIGABRT":
            out.append(
                f"rank {r} died of SIGABRT (exit {code}): Gloo aborts a rank when the sizes of a collective "
                "differ across ranks"
            )
        elif sig in ("SIGTERM", "SIGKILL") and r in outside:
            out.append(
                f"rank {r} was killed with {sig} (exit {code}) from outside the job: the launcher saw it fail "
                "first (torchrun's root cause), before it stopped any rank"
            )
        elif sig in ("SIGTERM", "SIGKILL") and outside:
            out.append(f"rank {r} was killed with {sig} (exit {code}) by the launcher, after {names(outside)} failed")
        elif sig in ("SIGTERM", "SIGKILL"):
            out.append(f"rank {r} was killed with {sig} (exit {code}), as the launcher does once another rank failed")
        elif sig:
            out.append(f"rank {r} died of {sig} (exit {code})")
        else:
            out.append(f"rank {r} exited with status {code}")
        raised = view.exception_line(r)
        if raised is not None:
            out.append(raised)
    return out


def _shared_gpus(view: RunView) -> list[str]:
    """Ranks of one host that issued their collectives on the same GPU (a job that never called
    ``torch.cuda.set_device``): NCCL refuses or hangs on it, whatever the code does next."""
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for trace in view.run.traces:
        device = next((e.device for e in trace.events if e.device and e.device != "cpu"), None)
        if device is not None:
            by_gpu.setdefault((trace.header.host, device), []).append(trace.rank)
    return [
        f"{names(ranks)} on host {host} issued their collectives on the same GPU, {device}: each rank needs "
        "its own (torch.cuda.set_device(local_rank) before init_process_group)"
        for (host, device), ranks in sorted(by_gpu.items())
        if len(ranks) > 1
    ]


def _collective_count(run: RunData) -> int:
    return sum(sum(g.values()) for g in run.last_seq.values()) + sum(sum(p.values()) for p in run.last_p2p.values())


# ---- how to say it ------------------------------------------------------------------------------


def _summary(
    view: RunView,
    verdict: Verdict,
    pattern: Pattern | None,
    div: Divergence | None,
    culprits: list[int],
    cycle: list[WaitEdge] | None,
    died: list[int],
    finding: Finding | None,
    candidates: Sequence[Candidate] = (),
) -> str:
    if verdict == Verdict.HEALTHY:
        return (
            f"Healthy: {_collective_count(view.run)} collectives on {len(view.groups)} group(s) agree across "
            f"{len(view.ranks)} rank(s) and nothing is stuck."
        )
    if verdict == Verdict.INTERRUPTED:
        why = view.run.manifest.interruption().removeprefix("the run was interrupted: ")
        return (
            f"Interrupted: {why}."
            f" Up to then, {_collective_count(view.run)} collectives on {len(view.groups)} group(s) agree across "
            f"{len(view.ranks)} rank(s) and no rank was stuck; the traces end where the stop found each rank (no "
            "desync, no hang). Whether the rest of the job is healthy cannot be told."
        )
    prefix = ""
    if died:
        first = _first_deaths(view, died)
        how = ", ".join(f"{_signal_name(view.exit_code(r)) or f'exit {view.exit_code(r)}'}" for r in first)
        if _killed_from_outside(view, died) == first:
            how += ", killed from outside the job"
        prefix = f"Crashed: {names(first)} died ({how})"
        then = [r for r in died if r not in first]
        if then and first != died:
            signals = sorted({_signal_name(view.exit_code(r)) or f"exit {view.exit_code(r)}" for r in then})
            prefix += f" first; {names(then)} then ended ({', '.join(signals)})"
        prefix += ". "
    title = f"{pattern.title}: " if pattern else ""
    if pattern is not None and pattern.id == "rank-stopped":
        return prefix + title + _stopped_summary(view, div, culprits)
    if cycle:
        waits = "; ".join(f"rank {e.rank} waits on group {e.group} for {names(e.waits_for)}" for e in cycle)
        return f"{prefix}{title}{waits}: a wait-for cycle across groups that no single group shows."
    if div is None:
        if pattern is not None and finding is not None and finding.evidence:
            return f"{prefix}{title}{finding.evidence[0]}."
        if verdict == Verdict.STUCK:
            return f"{prefix}Stuck: no rank made progress, but the traces show no divergence between ranks."
        return f"{prefix}No collective divergence was recorded.".strip()
    where = f"#{div.seq} of group {div.group.label()}"
    if div.kind == DivergenceKind.STALLED:
        v = next(iter(div.per_rank.values()))
        if pattern is not None and pattern.id == "not-a-desync":
            return (
                f"{prefix}{title}every rank of group {div.group.label()} is inside the same {v.op} #{div.seq} "
                f"({v.short_site}) with matching shapes and none completed it: suspect the hardware or "
                "network, not the code."
            )
        if pattern is None:
            found = next((Finding(c.score, c.evidence) for c in candidates if c.pattern == "not-a-desync"), None)
            why = not_established(found) or "no pattern's evidence was sufficient"
            return (
                f"{prefix}Stuck, cause not established: every rank of group {div.group.label()} issued the same "
                f"{v.op} #{div.seq} ({v.short_site}) last and none was seen completing it, but {why}; neither "
                "a hardware or network fault nor a desync can be named from this run (see Evidence)."
            )
    if div.kind == DivergenceKind.CONTRACT:
        v = next(x for x in div.per_rank.values() if x is not None)
        more = f" (and {len(div.breaches) - 1} more pair(s))" if len(div.breaches) > 1 else ""
        blame = f"; culprit {names(culprits)}" if culprits else "; culprit undetermined"
        return f"{prefix}{title}every rank issued {v.op} {where} ({v.short_site}), but {div.breaches[0]}{more}{blame}."
    if pattern is not None and pattern.id == "straggler":
        r = culprits[0] if culprits else div.missing[0]
        frame = view.stack_frame(r)
        stuck = f" is stuck in {frame}" if frame else " never arrives (no stack shows where it is)"
        waiting = [x for x, v in div.per_rank.items() if v is not None]
        v = div.per_rank[waiting[0]]
        if view.died(r):  # the crash path: the waiting ranks' own timeout ended the job (straggler.outlasted_wait)
            return (
                f"{prefix}{title}rank {r} was still working outside any collective (moedoctor run's busy record) "
                f"when {names(waiting)}, waiting in {v.op} {where}, reached {'its' if len(waiting) == 1 else 'their'} "
                "collective timeout."
            )
        return (
            f"{prefix}{title}rank {r}{stuck}, outside any collective, while {names(waiting)} "
            f"{'waits' if len(waiting) == 1 else 'wait'} in {v.op} {where}."
        )
    parts: list[str] = []
    same_op = len({v.op for v in div.per_rank.values() if v is not None}) == 1
    for cls in div.classes[:3]:
        v = div.per_rank.get(cls[0])
        site = ", ".join(x for x in (v.short_site, v.phase) if x) if v is not None else ""
        shapes = (" " + ",".join(str(list(s)) for s in v.shapes[:2])) if v is not None and same_op else ""
        did = "never issued it" if v is None else f"issued {v.op}{shapes} ({site})"
        parts.append(f"{names(cls)} {did}")
    blame = f"; culprit {names(culprits)}" if culprits else "; culprit undetermined"
    return f"{prefix}{title}at {where}, " + " while ".join(parts) + blame + "."


def _stopped_summary(view: RunView, div: Divergence | None, stopped: list[int]) -> str:
    """``rank 1's process is stopped (state T: ...), while ranks 0,2,3 wait in all_reduce #4 ...``."""
    by_state: dict[str | None, list[int]] = {}
    for r in stopped:
        state = view.process(r)
        by_state.setdefault(state.frozen if state is not None else None, []).append(r)
    text = "; ".join(
        f"{names(ranks)}'s process{'' if len(ranks) == 1 else 'es'} "
        f"{'is' if len(ranks) == 1 else 'are'} {FROZEN_STATES[frozen] if frozen else 'not running'}"
        for frozen, ranks in by_state.items()
    )
    if div is not None:
        waiting = sorted(r for r, v in div.per_rank.items() if v is not None and r not in stopped)
        if waiting:
            op, seq, short_site, _ = waits_in(view, div, waiting[0])
            site = f" ({short_site})" if short_site else ""
            text += (
                f", while {names(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in {op} #{seq} of "
                f"group {div.group.label()}{site}"
            )
    return text + ". Not a code desync: no change to the collectives applies."


def _suggestion(pattern: Pattern, finding: Finding | None, div: Divergence | None, culprits: list[int]) -> Suggestion:
    s = finding.suggestion if finding is not None else None
    if s is None:
        v = None
        if div is not None:
            v = next((div.per_rank[r] for r in culprits if div.per_rank.get(r) is not None), None)
            v = v or next((x for x in div.per_rank.values() if x is not None), None)
        s = Suggestion(v.call_site if v else None, v.function if v else None, pattern.advice)
    if s.call_site and s.source_line is None:
        file, _, line = s.call_site.rpartition(":")
        text = linecache.getline(file, int(line)).strip() if line.isdigit() else ""
        s = Suggestion(s.call_site, s.function, s.text, text or None)
    return s


def _rank_summaries(view: RunView) -> list[RankSummary]:
    out = []
    for r in _all_ranks(view):
        last = view.last_event.get(r)
        frame = view.stack_frame(r)
        dump = view.stack(r)
        stack = (
            f"{frame}"
            if frame
            else (f"unavailable: {dump.error.split('. ')[0]}" if dump is not None and dump.error else None)
        )
        m = view.run.manifest
        exit_ = m.exits.get(r) if m is not None else None
        out.append(
            RankSummary(
                rank=r,
                last=OpView.of(last) if last else None,
                group=last.group.name if last else None,
                waiting=last is not None and last.completed is None,
                stack=stack,
                in_collective=view.in_distributed(r),
                exit_code=exit_.exit_code if exit_ else None,
                exit_source=exit_.source if exit_ else None,
                process_state=None if dump is None or dump.process is None else dump.process.summary,
            )
        )
    return out


def _alignment(view: RunView, div: Divergence | None, culprits: list[int]) -> tuple[list[AlignedRow], list[int]]:
    if div is None:
        return [], []
    columns: list[int] = []
    for r in culprits:
        if r in div.per_rank and r not in columns:
            columns.append(r)
    for cls in div.classes:
        if not any(r in columns for r in cls):
            columns.append(cls[0])
    for r in div.per_rank:
        if len(columns) >= 2:
            break
        if r not in columns:
            columns.append(r)
    columns = sorted(columns[:MAX_COLUMNS])
    group = div.group.name
    if div.kind == DivergenceKind.P2P and div.peers:
        a, b = div.peers
        maps = {a: view.p2p_peers(group).get(a, {}).get(b, {}), b: view.p2p_peers(group).get(b, {}).get(a, {})}
    else:
        maps = {r: view.seq_map(r, group) for r in div.per_rank}
    rows = []
    for seq in range(max(1, div.seq - ROWS_BEFORE), div.seq + ROWS_AFTER + 1):
        events = {r: maps.get(r, {}).get(seq) for r in maps}
        if not any(events.values()):
            continue
        sigs = {
            r: (e.signature(), e.reduce_op) if e is not None else None
            for r, e in events.items()
            if e is not None or (div.kind != DivergenceKind.P2P and view.never_reached(r, group, seq))
        }
        counts: dict = {}
        for s in sigs.values():
            key = None if s is None else s[0]
            counts[key] = counts.get(key, 0) + 1
        majority = max(counts, key=lambda k: (counts[k], k is not None)) if counts else None
        if div.kind == DivergenceKind.P2P and seq == div.seq:
            diverging = frozenset(columns)
        else:
            tied = list(counts.values()).count(counts[majority]) > 1 if counts else False
            diverging = frozenset(
                r
                for r, s in sigs.items()
                if r in columns and len(counts) > 1 and ((s[0] if s else None) != majority or tied)
            )
        rows.append(AlignedRow(seq, {r: OpView.of(events[r]) if events.get(r) else None for r in columns}, diverging))
    return rows, columns


__all__ = ["analyze", "Culprits"]
