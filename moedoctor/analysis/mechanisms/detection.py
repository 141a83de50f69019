"""Level 1 of a diagnosis: the mechanism, what the traces and the ranks' states show happened.

A small, exhaustive vocabulary defined only on the structure of the recorded collectives (which
rank issued what, at which sequence number of which group, from which call site, in which step) and
on the ranks' states (inside a collective or not, process running, stopped or dead). It reads no
phase name, no module name, no job source and no recorder evidence record: it claims nothing the
traces do not show, so it holds on code moedoctor has never seen. The patterns (level 2,
``analysis.patterns``, each with its declaration) refine a mechanism
with domain evidence; when none has the evidence it needs, the mechanism is the diagnosis.

Exactly one mechanism per divergence (``mechanism_of``), chosen in this order: a cycle of waits
across groups; every member inside the same collective; an unmatched point-to-point op; a broken
size contract; at one position, the same op with other shapes, dtypes or reduce op; gradient
reductions held back past a collective issued after the backward pass (a different op); a loop of one
call site run a different number of times; collectives some ranks skipped or added, read by
aligning the ranks' streams on the history they share (``alignment.aligned_finding``); the step's repeated part run
a different number of times; a collective no other rank issued; the same position holding
different collectives; ranks the others wait for that are outside any collective (their state
said). Each reading lives in its own module (``loops``, ``alignment``, ``held_back``,
``mismatch``, ``missing``); this one keeps the order. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from moedoctor.analysis.evidence.steps import cycle_loop_exit, loop_exit, period_exit
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.culprits import Culprits
from moedoctor.analysis.mechanisms.held_back import held_back_finding, held_back_pass
from moedoctor.analysis.mechanisms.loops import alternating, loop_text, moved_on, pass_restarted, unit_skipped
from moedoctor.analysis.mechanisms.mismatch import at_mismatch, same_op
from moedoctor.analysis.mechanisms.missing import at_missing
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding, RankState
from moedoctor.analysis.mechanisms.wording import short_site
from moedoctor.analysis.model import Divergence, DivergenceKind, WaitEdge
from moedoctor.wording import rank_names


def mechanism_of(
    view: RunView, div: Divergence | None, culprits: Culprits, edges: list[WaitEdge], cycle: list[WaitEdge] | None
) -> MechanismFinding | None:
    """The one mechanism of the primary divergence (None: no divergence)."""
    if div is None:
        return None
    present = {r: v for r, v in div.per_rank.items() if v is not None}
    sites = {r: v.call_site for r, v in present.items() if v.call_site}
    functions = {r: v.function for r, v in present.items() if v.function}
    first = next(iter(present.values()), None)
    base: dict[str, Any] = dict(
        group=div.group.label(),
        seq=div.seq,
        sites=sites,
        functions=functions,
        # The earliest step among the ranks: where they parted (a rank that went on counts one more).
        step=min(v.step for v in present.values()) if present else None,
        phase=min(present.values(), key=lambda v: v.step).phase if present else None,
    )
    members = tuple(sorted(div.per_rank))

    def made(mech: Mechanism, ranks, detail: str, **kw) -> MechanismFinding:
        ranks = tuple(sorted(ranks))
        others = tuple(r for r in members if r not in ranks)
        return MechanismFinding(mech, ranks=ranks, others=others, detail=detail, **{**base, **kw})

    if cycle:
        waits = "; ".join(
            f"rank {e.rank} waits in {e.op} #{e.seq} of group {e.group} for {rank_names(e.waits_for)}" for e in cycle
        )
        looped = cycle_loop_exit(view, cycle)
        extra = f" (on group {looped[0]}, {loop_text(looped[1])})" if looped else ""
        cyc = tuple(sorted({e.rank for e in cycle}))
        return MechanismFinding(
            Mechanism.WAIT_CYCLE,
            ranks=cyc,
            others=(),
            detail=waits + extra,
            **{**base, "group": cycle[0].group, "seq": cycle[0].seq},
        )
    if div.kind == DivergenceKind.STALLED:
        return made(
            Mechanism.TRANSPORT_HANG,
            (),
            f"every member of group {div.group.label()} is inside {first.op if first else 'the same collective'} "
            f"#{div.seq} ({short_site(first.call_site if first else None)}) and none completed it",
        )
    if div.kind == DivergenceKind.P2P:
        a, b = div.peers or (None, None)
        lone = tuple(r for r in (a, b) if r is not None and r in present)
        return made(
            Mechanism.UNMATCHED_P2P,
            lone,
            f"p2p #{div.seq} between ranks {a} and {b}: "
            + ("; ".join(f"rank {r} posted {v.op} ({short_site(v.call_site)})" for r, v in present.items()) or "no op"),
        )
    if div.kind == DivergenceKind.CONTRACT:
        return made(Mechanism.DIFFERENT_SPLITS, culprits.ranks, "; ".join(div.breaches[:2]))
    if div.kind == DivergenceKind.MISMATCH and len({(v.op, v.call_site) for v in present.values()}) == 1:
        found = same_op(div, present, culprits, made)
        if found is not None:
            return found
    if div.kind == DivergenceKind.MISMATCH:
        held = held_back_pass(view, div.group.name, div.seq, sorted(present))
        if held is not None:
            return held_back_finding(view, div, held, made)
    exit_ = loop_exit(view, div.group.name, div.seq, list(div.per_rank))
    if (
        exit_ is not None
        and div.kind == DivergenceKind.MISSING
        and not all(view.finished(r) or moved_on(view, r, exit_.site) for r in exit_.left)
    ):
        exit_ = None  # a rank that issued nothing since its last iteration has not left the loop: not arrived
    if (
        exit_ is not None
        and div.kind == DivergenceKind.MISMATCH
        and pass_restarted(view, div.group.name, div.seq, exit_) is None
        and alternating(view, div.group.name, div.seq, exit_)
    ):
        exit_ = None  # a walk whose items issue one of two collectives: another path at one item, not a loop exit
    if exit_ is None and div.kind == DivergenceKind.MISMATCH:
        exit_ = period_exit(view, div.group.name, div.seq, list(div.per_rank))
    if exit_ is not None:
        unit_skip = unit_skipped(view, div.group.name, div.seq, exit_)
        if unit_skip is not None:
            at, skipped, went_on = unit_skip
            return made(
                Mechanism.SKIPPED_COLLECTIVE,
                exit_.left,
                f"{rank_names(exit_.left)} left out the {'unit' if len(skipped) == 1 else 'units'} "
                f"{', '.join(skipped)} of the per-unit collectives at {exit_.short} that "
                f"{rank_names(exit_.looping)} issued, and went on with the next unit ({went_on}): "
                "each iteration is another FSDP unit, so a unit missing in the middle is a skipped "
                "collective, not a shorter loop",
                seq=at,
            )
        restart = pass_restarted(view, div.group.name, div.seq, exit_)
        if restart is not None:
            at, n, after = restart
            return made(
                Mechanism.SKIPPED_COLLECTIVE,
                exit_.looping,
                f"every earlier pass of the loop at {exit_.short} issued the same {n} items and then "
                f"{after}; {rank_names(exit_.looping)} issued the first item again after {n}, beginning the "
                f"next pass, while {rank_names(exit_.left)} went on with {after} as before: "
                f"{rank_names(exit_.looping)} skipped what follows the loop",
                seq=at,
            )
        return made(
            Mechanism.LOOP_TRIP_COUNT, exit_.left, loop_text(exit_), counts=dict(exit_.counts), loop_site=exit_.site
        )
    if div.kind == DivergenceKind.MISMATCH:
        return at_mismatch(view, div, present, culprits, made)
    return at_missing(view, div, present, edges, made)


def mechanism_from_stacks(inside: list, outside: list, frozen: dict[int, str]) -> MechanismFinding | None:
    """The mechanism a job known only by its ranks' stacks shows (``analysis.from_stacks``'s classes
    of identical stacks, those inside a collective and those outside, and the ranks whose process
    does not run). No sequence numbers or shapes: a different op at one position and a cycle across
    groups both look like ranks waiting in different collectives. None: no rank waits in one."""
    if not inside:
        return None
    waiting = tuple(sorted(r for c in inside for r in c.ranks))
    sites = {r: c.stack.where() for c in inside for r in c.ranks}
    first = inside[0].stack
    made: dict[str, Any] = dict(group="?", seq=0, sites=sites, functions={})
    if frozen:
        stopped = tuple(sorted(frozen))
        return MechanismFinding(
            Mechanism.RANK_OUTSIDE,
            ranks=stopped,
            others=waiting,
            state=RankState.STOPPED,
            detail=f"{rank_names(stopped)}'s process does not run",
            **made,
        )
    if outside:
        away = tuple(sorted(r for c in outside for r in c.ranks))
        return MechanismFinding(
            Mechanism.RANK_OUTSIDE,
            ranks=away,
            others=waiting,
            state=RankState.WORKING,
            detail=f"{rank_names(waiting)} wait in {first.waits_in} ({first.where()}) while {rank_names(away)} "
            f"{'is' if len(away) == 1 else 'are'} outside any collective, in {outside[0].stack.where()}",
            **made,
        )
    if len(inside) == 1 or len({(c.stack.waits_in, c.stack.where()) for c in inside}) == 1:
        return MechanismFinding(
            Mechanism.TRANSPORT_HANG,
            ranks=(),
            others=waiting,
            detail=f"every rank seen waits in {first.waits_in} from {first.where()}",
            **made,
        )
    per = " while ".join(f"{rank_names(c.ranks)} wait in {c.stack.waits_in} ({c.stack.where()})" for c in inside[:3])
    return MechanismFinding(
        Mechanism.DIFFERENT_OP,
        ranks=tuple(inside[-1].ranks),
        others=tuple(inside[0].ranks),
        detail=f"{per} (one group out of order, or a cycle across groups: stacks cannot tell)",
        **made,
    )
