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
aligning the ranks' streams on the history they share (``_aligned``); the step's repeated part run
a different number of times; a collective no other rank issued; the same position holding
different collectives; ranks the others wait for that are outside any collective (their state
said). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from moedoctor.analysis.mechanisms.culprits import Culprits
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding, RankState
from moedoctor.analysis.mechanisms.wording import short_site
from moedoctor.analysis.evidence.source import same_loop
from moedoctor.analysis.model import Divergence, DivergenceKind, WaitEdge
from moedoctor.analysis.evidence.steps import (
    CLOSING,
    LOOKBACK,
    RESTART,
    LoopExit,
    another_pass,
    cycle_loop_exit,
    loop_exit,
    period_exit,
    position,
    shape_token,
    token,
    usual_pass,
)
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.waitfor import chain_roots
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names


def rank_state(view: RunView, rank: int) -> RankState:
    """The waited-for rank's state, from its exit status, process state, exception and stack."""
    if view.frozen(rank):
        return RankState.STOPPED
    if view.exception(rank) is not None and (view.died(rank) or view.exit_code(rank) is not None):
        return RankState.CRASHED
    if view.died(rank) or view.finished(rank):
        return RankState.DEAD
    if view.in_distributed(rank) is False:
        return RankState.WORKING
    return RankState.UNKNOWN


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
        extra = f" (on group {looped[0]}, {_loop_text(looped[1])})" if looped else ""
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
        found = _same_op(div, present, culprits, made)
        if found is not None:
            return found
    if div.kind == DivergenceKind.MISMATCH:
        held = _held_back_pass(view, div.group.name, div.seq, sorted(present))
        if held is not None:
            return held_back_finding(view, div, held, made)
    exit_ = loop_exit(view, div.group.name, div.seq, list(div.per_rank))
    if (
        exit_ is not None
        and div.kind == DivergenceKind.MISSING
        and not all(view.finished(r) or _moved_on(view, r, exit_.site) for r in exit_.left)
    ):
        exit_ = None  # a rank that issued nothing since its last iteration has not left the loop: not arrived
    if (
        exit_ is not None
        and div.kind == DivergenceKind.MISMATCH
        and _pass_restarted(view, div.group.name, div.seq, exit_) is None
        and _alternating(view, div.group.name, div.seq, exit_)
    ):
        exit_ = None  # a walk whose items issue one of two collectives: another path at one item, not a loop exit
    if exit_ is None and div.kind == DivergenceKind.MISMATCH:
        exit_ = period_exit(view, div.group.name, div.seq, list(div.per_rank))
    if exit_ is not None:
        unit_skip = _unit_skipped(view, div.group.name, div.seq, exit_)
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
        restart = _pass_restarted(view, div.group.name, div.seq, exit_)
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
            Mechanism.LOOP_TRIP_COUNT, exit_.left, _loop_text(exit_), counts=dict(exit_.counts), loop_site=exit_.site
        )
    if div.kind == DivergenceKind.MISMATCH:
        return _mismatch(view, div, present, culprits, made)
    return _missing(view, div, present, edges, made)


def _unit_run(view: RunView, rank: int, group: str, seq: int, site: str) -> list[CollectiveEvent]:
    """The rank's last run (one step, one phase) of collectives from ``site`` on ``group`` up to ``seq``."""
    evs = view.events(rank, group, before=seq + 1)
    last = max((i for i, e in enumerate(evs) if e.call_site is not None and e.call_site.where == site), default=None)
    if last is None:
        return []
    run: list[CollectiveEvent] = []
    for e in reversed(evs[: last + 1]):
        if token(e)[:2] != token(evs[last])[:2] or e.step != evs[last].step or e.phase != evs[last].phase:
            break
        run.append(e)
    return run[::-1]


def _unit_skipped(view: RunView, group: str, seq: int, exit_: LoopExit) -> tuple[int, list[str], str] | None:
    """A loop exit whose iterations are each another FSDP unit (every collective of the run names a
    unit, none twice), where every rank that "left" issued a unit that the looping ranks issued
    only after one it never issued in the run: it left out that unit in the middle of the sequence
    and went on with the next ones. "The same collective" includes the FSDP unit, so this is a
    skipped collective. A rank whose units are a prefix of the others' (it stopped early) stays a
    loop exit. Returns (the position where the units first differ, the units left out, the unit it
    went on with), or None."""
    runs = {r: _unit_run(view, r, group, seq, exit_.site) for r in (*exit_.looping, *exit_.left)}
    units = {r: [e.module for e in run] for r, run in runs.items()}
    if any(not u or None in u or len(set(u)) != len(u) for u in units.values()):
        return None
    ref = units[exit_.looping[0]]
    if any(units[r] != ref for r in exit_.looping[1:]):
        return None
    at: int | None = None
    skipped: list[str] = []
    went_on = ""
    for r in exit_.left:
        mine = units[r]
        i = next((k for k, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        if i is None or mine[i] not in ref[i + 1 :]:
            return None  # a prefix of the others' units, or a unit they never issued: not a skip
        missing = ref[i : ref.index(mine[i])]
        if any(m in mine for m in missing):
            return None  # the left-out unit comes later: another reading (a reordering)
        pos = runs[r][i].seq
        at = pos if at is None else min(at, pos)
        skipped.extend(m for m in missing if m not in skipped)
        went_on = mine[i]
    if at is None:
        return None
    return at, skipped, went_on


def _runs(evs: list[CollectiveEvent], key: tuple) -> list[list[CollectiveEvent]]:
    """The maximal runs of consecutive collectives of ``key`` (op, call site) in ``evs``."""
    runs: list[list[CollectiveEvent]] = []
    for i, e in enumerate(evs):
        if token(e)[:2] != key:
            continue
        if i and token(evs[i - 1])[:2] == key and runs:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def _pass_restarted(view: RunView, group: str, seq: int, exit_: LoopExit) -> tuple[int, int, str] | None:
    """A loop exit where the "looping" ranks did not loop longer but began the next pass: the last
    two earlier runs of the loop's collective, on every rank, were the same ``n`` items (the same
    sequence of sizes, at least two different ones), every earlier run followed by the same
    collective; the ranks that "left" issued the ``n`` items and went on with that collective, and
    the looping ranks issued them and then the first items again (the sequence restarted). They
    skipped what every earlier pass issued after the loop. (Where the step counter parts the runs,
    a run is counted within one step and never reaches past ``n``.) Returns (the position of the
    restart, ``n``, the collective the others went on with), or None."""
    ranks = (*exit_.looping, *exit_.left)
    evs = {r: view.events(r, group, before=seq + 1) for r in ranks}
    key = token(evs[exit_.looping[0]][-1])[:2]
    runs = {r: _runs(evs[r], key) for r in ranks}
    if any(len(rs) < 3 for rs in runs.values()):
        return None
    items = [e.in_shapes for e in runs[exit_.looping[0]][-2]]
    n = len(items)
    if n < 2 or len(set(items)) < 2:
        return None
    follow = set()
    for r in ranks:
        earlier = runs[r][:-1]
        if any([e.in_shapes for e in run] != items for run in earlier[-2:]):
            return None
        for run in earlier:
            idx = evs[r].index(run[-1])
            if idx + 1 < len(evs[r]):
                follow.add(token(evs[r][idx + 1])[:2])
    if len(follow) != 1:
        return None
    after = next(iter(follow))
    for r in exit_.left:
        if [e.in_shapes for e in runs[r][-1]] != items:
            return None
        idx = evs[r].index(runs[r][-1][-1])
        if idx + 1 >= len(evs[r]) or token(evs[r][idx + 1])[:2] != after:
            return None
    at: int | None = None
    for r in exit_.looping:
        cur = runs[r][-1]
        if cur[-1] is not evs[r][-1] or len(cur) <= n:
            return None
        shapes = [e.in_shapes for e in cur]
        if shapes[:n] != items or shapes[n:] != items[: len(shapes) - n]:
            return None
        at = cur[n].seq if at is None else min(at, cur[n].seq)
    if at is None:
        return None
    return at, n, f"{after[0]} ({short_site(after[1])})"


def _alternating(view: RunView, group: str, seq: int, exit_: LoopExit) -> bool:
    """Is the collective the "left" ranks issued at ``seq`` one that every rank already issued in
    this pass (same step and phase), between items of the loop (the loop's collective issued both
    before and after it)? Then the loop does not issue one collective per iteration: each item
    issues one of the two, and at ``seq`` the ranks took different paths at one item (a
    different op), not a loop that some ranks left."""
    here = [view.event(r, group, seq) for r in exit_.left]
    if any(e is None or e.call_site is None for e in here):
        return False
    nexts = {token(e)[:2] for e in here if e is not None}
    if len(nexts) != 1:
        return False
    other = next(iter(nexts))
    for r in (*exit_.looping, *exit_.left):
        at = view.event(r, group, seq)
        if at is None:
            return False
        evs = [e for e in view.events(r, group, before=seq) if e.step == at.step and e.phase == at.phase]
        marks = [token(e)[:2] for e in evs]
        firsts = [i for i, t in enumerate(marks) if t == other]
        if not firsts or not any(t[1] == exit_.site for t in marks[: firsts[0]]):
            return False
        if not any(t[1] == exit_.site for t in marks[firsts[-1] + 1 :]):
            return False
    return True


def _moved_on(view: RunView, rank: int, site: str) -> bool:
    """The rank issued a collective from another call site (any group) after its last one from ``site``."""
    events = view.rank_events(rank)
    last = max((i for i, e in enumerate(events) if e.call_site is not None and e.call_site.where == site), default=None)
    return last is not None and any(e.call_site is None or e.call_site.where != site for e in events[last + 1 :])


def _loop_text(exit_: LoopExit) -> str:
    counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(exit_.counts.items()))
    return (
        f"a loop of one collective per iteration at {exit_.short}: {rank_names(exit_.left)} left it after fewer "
        f"iterations while {rank_names(exit_.looping)} went on ({counts})"
    )


def _same_op(div: Divergence, present: dict, culprits: Culprits, made) -> MechanismFinding | None:
    views = list(present.values())
    if len({v.shapes for v in views}) > 1 or len({v.out_shapes for v in views}) > 1:
        mech, what = Mechanism.DIFFERENT_SHAPE, "shapes"
    elif len({v.dtypes for v in views}) > 1:
        mech, what = Mechanism.DIFFERENT_DTYPE, "dtypes"
    elif len({v.reduce_op for v in views if v.reduce_op}) > 1:
        mech, what = Mechanism.DIFFERENT_REDUCE_OP, "reduce ops"
    elif len({v.splits for v in views}) > 1:
        mech, what = Mechanism.DIFFERENT_SPLITS, "splits"
    else:
        return None  # the same arguments (another FSDP unit, another root): read as different collectives
    v = views[0]
    per = "; ".join(
        f"{rank_names(cls)}: "
        + (
            ",".join(str(list(s)) for s in present[cls[0]].shapes[:2])
            if what == "shapes"
            else "/".join(present[cls[0]].dtypes)
            if what == "dtypes"
            else str(present[cls[0]].reduce_op)
            if what == "reduce ops"
            else str(present[cls[0]].splits)
        )
        for cls in div.classes
        if cls and cls[0] in present
    )
    return made(
        mech, culprits.ranks, f"every rank issued {v.op} from {short_site(v.call_site)} with different {what} ({per})"
    )


#: Ranks whose whole stream is read to call a collective new to them (the first ones, by rank): the
#: claim is made on these, so a 256-rank job costs what an 8-rank one does.
NOVELTY_RANKS = 8


def _stream_tokens(view: RunView, rank: int, group: str, before: int) -> set:
    """(op, call site) of every collective the rank issued on the group before ``before``."""
    return {
        (e.op, e.call_site.where if e.call_site else None) for s, e in view.seq_map(rank, group).items() if s < before
    }


def _mismatch(view: RunView, div: Divergence, present: dict, culprits: Culprits, made) -> MechanismFinding:
    group = div.group.name
    aligned = _aligned(view, group, div.seq, sorted(present), made)
    if aligned is not None:
        return aligned
    events = {r: view.event(r, group, div.seq) for r in present}
    positions = {r: position(view, e) for r, e in events.items() if e is not None}
    restart = [r for r, p in positions.items() if p == RESTART]
    closing = [r for r, p in positions.items() if p == CLOSING]
    if restart and not closing:
        closing = _stepped(view, events, restart)
    if (
        restart
        and closing
        and all(events[r].phase.value == "backward" for r in restart)
        and all(_forward_site_of_step(view, events[r]) for r in restart)
    ):
        # Issued again while a backward pass runs, from a call site of this step's forward: a re-issue
        # inside backward (a recompute) that the other ranks did not make. A call site the step issued
        # only in backward (a gradient bucket) issued again opens another micro-batch: below.
        return made(
            Mechanism.SKIPPED_COLLECTIVE,
            closing,
            f"{rank_names(restart)} issued {_what(events, restart)} again during a backward pass, a call site "
            f"they issued earlier in this step; {rank_names(closing)} did not and went on ({_what(events, closing)})",
        )
    if restart and closing and another_pass(view, [e for e in events.values() if e is not None], positions):
        loop = _inside_loop(events, restart, closing)
        if loop is not None:
            # The "closing" collective is issued from inside the very loop the others go round again,
            # outside forward and backward: those ranks did not leave the loop, they issued an extra
            # collective within one of its iterations.
            return made(
                Mechanism.EXTRA_COLLECTIVE,
                closing,
                f"{rank_names(closing)} issued {_what(events, closing)} inside the loop at {loop.short} "
                f"({loop.text}), which {rank_names(restart)} went on with ({_what(events, restart)}): "
                "an extra collective within an iteration, not a loop left early",
            )
        return made(
            Mechanism.LOOP_TRIP_COUNT,
            closing,
            f"{rank_names(restart)} began another pass over the step's repeated part "
            f"({_what(events, restart)}) while {rank_names(closing)} closed the step ({_what(events, closing)})",
        )
    classes = [c for c in div.classes if c and c[0] in present]
    # A collective whose (op, call site) the other side never issued on this group: an extra one.
    novel = []
    for cls in classes:
        mine = token(events[cls[0]])[:2] if events.get(cls[0]) else None
        others = sorted(r for r in present if r not in cls)[:NOVELTY_RANKS]
        if mine is not None and others and all(mine not in _stream_tokens(view, o, group, div.seq + 1) for o in others):
            novel.append(cls)
    if len(novel) == 1:
        cls = novel[0]
        return made(
            Mechanism.EXTRA_COLLECTIVE,
            cls,
            f"{rank_names(cls)} issued {_what(events, cls)}, a collective "
            f"the other ranks never issued on group {div.group.label()} "
            f"(they issued {_what(events, [r for r in present if r not in cls])})",
        )
    deviating = (
        [r for r in culprits.ranks if r in present] if culprits.rule in ("own-steps", "own-period", "minority") else []
    )
    if deviating and len(deviating) < len(present):
        others = [r for r in present if r not in deviating]
        e, o = events[deviating[0]], events[others[0]]
        habit = _previous_step(view, deviating[0], e)
        if habit is not None and o is not None and token(o)[:2] in [token(x)[:2] for x in habit[:1]]:
            later = [token(x)[:2] for x in habit[1:]]
            after = [token(x)[:2] for x in view.events(deviating[0], group) if x.seq > div.seq]
            if token(e)[:2] in later and after and token(o)[:2] not in after:
                # It went on past the collective its habit puts first, without issuing it: skipped.
                # (Blocked at the divergence, it may only have reordered: a different op, below.)
                return made(
                    Mechanism.SKIPPED_COLLECTIVE,
                    deviating,
                    f"{rank_names(deviating)} issued {_what(events, deviating)} "
                    f"where their own previous step issued {_what(events, others)} first, as "
                    f"{rank_names(others)} {'does' if len(others) == 1 else 'do'}: they skipped it",
                )
            if token(e)[:2] not in [token(x)[:2] for x in _previous_step(view, deviating[0], e, whole=True) or []]:
                return made(
                    Mechanism.EXTRA_COLLECTIVE,
                    deviating,
                    f"{rank_names(deviating)} issued {_what(events, deviating)}, which their own previous step "
                    f"never issued, where that step, like {rank_names(others)} now, issued {_what(events, others)}",
                )
    per = " while ".join(f"{rank_names(c)} issued {_what(events, c)}" for c in classes[:3])
    return made(Mechanism.DIFFERENT_OP, deviating, f"at the same position {per}")


#: Longest context (collectives every rank agreed on just before the divergence) looked up in the
#: ranks' shared history, and how far past the expected collective a skipping rank's one is sought.
CONTEXT, AHEAD = 4, 32
#: How much of the shared history is read (the most recent collectives).
HISTORY = 512


def _stepped(view: RunView, events: dict, restart: list[int]) -> list[int]:
    """The ranks that closed the step the ``restart`` ranks go on with: every other rank whose
    collective is the first of the next step on the group (it ran the optimizer step) after at least
    one backward pass in that step, and no more passes than the restart ranks had begun when they
    began another, a pass their earlier steps show room for (``steps.usual_pass``: not the next
    iteration of a rank that skipped its step). Empty: any other rank is elsewhere."""
    steps = {events[r].step for r in restart if events.get(r) is not None}
    if len(steps) != 1:
        return []
    (step,) = steps
    if not all(usual_pass(view, events[r]) for r in restart):
        return []
    begun = min(sum(1 for b in view.evidence(r, "backward_begin", step) if b.time < events[r].time) for r in restart)
    found = []
    for r, e in events.items():
        if r in restart:
            continue
        if e is None or e.step != step + 1:
            return []
        before = view.events(r, e.group.name, before=e.seq)
        if not before or before[-1].step != step:
            return []
        ran = sum(1 for b in view.evidence(r, "backward_begin", step) if b.time < e.time)
        stepped = any(before[-1].time < x.time < e.time for x in view.evidence(r, "optimizer_step_end"))
        if not stepped or not 1 <= ran <= begun:
            return []
        found.append(r)
    return found


def _forward_site_of_step(view: RunView, e: CollectiveEvent) -> bool:
    """The rank issued ``e``'s call site in a forward pass earlier in ``e``'s step."""
    site = e.call_site.where if e.call_site else None
    return site is not None and any(
        x.step == e.step and x.phase.value == "forward" and x.call_site is not None and x.call_site.where == site
        for x in view.events(e.rank, e.group.name, before=e.seq)
    )


def _inside_loop(events: dict, restart: list[int], closing: list[int]):
    """The loop the ``restart`` ranks go round again when every ``closing`` rank's collective is
    issued outside forward and backward from inside that same loop (``source.same_loop``)."""
    if not restart or not closing or events.get(restart[0]) is None or events[restart[0]].call_site is None:
        return None
    again = events[restart[0]].call_site.stack
    loop = None
    for r in closing:
        e = events.get(r)
        if e is None or e.call_site is None or e.phase.value in ("forward", "backward"):
            return None
        loop = same_loop(e.call_site.stack, again)
        if loop is None:
            return None
    return loop


def _first_parting(view: RunView, group: str, seq: int, ranks: list[int]) -> int | None:
    """The first sequence number, at most ``LOOKBACK`` before ``seq``, where the ranks' collectives
    differ in op, call site, FSDP unit or input shapes (ops of the same size pair silently, so the
    ranks may have parted a few collectives before the divergence the matcher saw); None: a rank
    lacks a collective there."""
    for s in range(max(1, seq - LOOKBACK), seq + 1):
        here = [view.event(r, group, s) for r in ranks]
        if any(e is None for e in here):
            continue
        if len({shape_token(e) for e in here if e is not None}) > 1:
            return s
    return None


def expected_next(history: list[tuple]) -> tuple[int, tuple] | None:
    """What the ranks' shared history says comes next: what followed the suffixes of ``history`` (its
    last collective, its last two, ... up to ``CONTEXT``) where they occurred earlier in it, when
    every earlier occurrence of every such suffix was followed by the same collective: (index in
    ``history`` of the most recent such continuation, the collective). None: the last collective
    never occurred before, or some suffix was followed by different collectives (a loop whose count
    varies: the history does not say which side is the normal one)."""
    found = None
    for c in range(1, min(CONTEXT, len(history) - 1) + 1):
        suffix = history[-c:]
        after = [j + c for j in range(len(history) - c) if history[j : j + c] == suffix]
        if not after:
            break
        if len({history[a] for a in after}) > 1 or (found is not None and history[after[-1]] != found[1]):
            return None
        found = after[-1], history[after[-1]]
    return found


def _history(view: RunView, group: str, seq: int, ranks: list[int]) -> tuple[int, dict, list[tuple]] | None:
    """(first position where the ranks part, their collectives there, the tokens of the history every
    rank shares before it, its last ``HISTORY`` collectives); None: no such position, or the ranks'
    streams differ before it too (per-rank sizes: no shared history to align on; compared on the
    first ``NOVELTY_RANKS`` ranks, so a 256-rank job costs what an 8-rank one does)."""
    start = _first_parting(view, group, seq, ranks)
    if start is None:
        return None
    history = [shape_token(e) for e in _recent(view, ranks[0], group, start)]
    if len(history) < 2:
        return None
    if any([shape_token(e) for e in _recent(view, r, group, start)] != history for r in ranks[1:NOVELTY_RANKS]):
        return None
    return start, {r: view.event(r, group, start) for r in ranks}, history


def _recent(view: RunView, rank: int, group: str, start: int) -> list[CollectiveEvent]:
    """The rank's collectives on the group at the ``HISTORY`` sequence numbers before ``start``."""
    issued = view.seq_map(rank, group)
    return [issued[s] for s in range(max(1, start - HISTORY), start) if s in issued]


def left_out(view: RunView, group: str, seq: int, ranks: list[int]) -> dict[int, list[CollectiveEvent]] | None:
    """The collectives each skipping rank left out, read by aligning the ranks' streams on their
    shared history (``_aligned``): rank -> the history's collectives it went past (as the first rank
    issued them earlier). None or empty: no rank skipped any by that reading."""
    found = _history(view, group, seq, ranks)
    return None if found is None else _skips(view, group, ranks, found)


def _skips(
    view: RunView, group: str, ranks: list[int], found: tuple[int, dict, list[tuple]]
) -> dict[int, list[CollectiveEvent]] | None:
    """``left_out`` on the ranks' shared history already read (``_history``)."""
    start, here, history = found
    following = expected_next(history)
    if following is None:
        return None
    at, expected = following
    tokens = {r: shape_token(e) for r, e in here.items() if e is not None}
    normal = [r for r in ranks if tokens.get(r) == expected]
    deviating = [r for r in ranks if r not in normal]
    if not normal or not deviating:
        return None
    ahead = history[at + 1 : at + 1 + AHEAD]
    skips = {r: ahead.index(tokens[r]) + 1 for r in deviating if tokens.get(r) in ahead}
    if len(skips) < len(deviating):
        return None
    if any(
        _issued_later(view, r, group, start, set(history[at : at + n]))
        or _held_back(view, r, here[r], start, history, at, n)
        for r, n in skips.items()
    ):
        return None
    events = _recent(view, ranks[0], group, start)
    return {r: events[at : at + n] for r, n in skips.items()}


def _aligned(view: RunView, group: str, seq: int, ranks: list[int], made) -> MechanismFinding | None:
    """Skipped or extra collectives, read by aligning the ranks' streams on their shared history.

    Before the first position where they part, every rank issued the same collectives (op, call site,
    unit, shapes). What that history says comes next (``expected_next``) singles out the normal side:
    the ranks that issued it. A deviating rank whose collective is the one the history puts ``m``
    places further skipped ``m`` collectives (its stream at k equals the others' expected stream at
    k+m). With no such continuation: a deviating rank that issued again the collective all ranks
    issued just before, a repeat the history never shows, issued an extra one (the others went on).
    """
    found = _history(view, group, seq, ranks)
    if found is None:
        return None
    start, here, history = found
    tokens = {r: shape_token(e) for r, e in here.items() if e is not None}
    following = expected_next(history)
    skipped = _skips(view, group, ranks, found)
    if skipped:
        normal = [r for r in ranks if r not in skipped]
        deviating = sorted(skipped)
        n = max(len(x) for x in skipped.values())
        return made(
            Mechanism.SKIPPED_COLLECTIVE,
            deviating,
            f"{rank_names(deviating)} issued {_what(here, deviating)} at #{start} where "
            f"{rank_names(normal)} issued {_what(here, normal)}, as every earlier occurrence of the "
            f"preceding collectives was followed: {rank_names(deviating)} left out "
            f"{n} collective{'s' if n > 1 else ''} the others issue",
            seq=start,
            sites=_sites(here),
        )
    last = history[-1]
    repeats = [r for r in ranks if tokens.get(r) == last]
    went_on = [r for r in ranks if r not in repeats]
    recurring = all(history.count(tokens[r]) >= 2 for r in went_on if r in tokens)
    if repeats and went_on and recurring and all(a != b or a != last for a, b in zip(history, history[1:])):
        if following is None or all(tokens.get(r) == following[1] for r in went_on):
            return made(
                Mechanism.EXTRA_COLLECTIVE,
                repeats,
                f"{rank_names(repeats)} issued {_what(here, repeats)} a second time in a row at #{start}, "
                f"a repeat the earlier collectives never show, while {rank_names(went_on)} went on "
                f"({_what(here, went_on)})",
                seq=start,
                sites=_sites(here),
            )
    return None


def _issued_later(view: RunView, rank: int, group: str, start: int, tokens: set) -> bool:
    """The rank issued one of ``tokens`` after ``start``: it reordered them, it did not leave them out."""
    return any(shape_token(e) in tokens for s, e in view.seq_map(rank, group).items() if s > start)


def _held_back_pass(view: RunView, group: str, seq: int, ranks: list[int]) -> tuple[list[int], list[int]] | None:
    """(held, others) where, at the first position the ranks part, the ``held`` ranks' backward pass
    ended since their previous collective on the group and they issued a collective outside forward
    and backward, while the ``others``, in the same backward pass of the same step (as many passes
    begun in it), issued a collective from a call site the held ranks issued during their own pass:
    the held ranks' pass issued fewer of the gradient reductions it issues (held back to a later
    flush, hooks that did not fire), and what they issued next lands where the others' reduction is.
    None: any rank fits neither side, or a side is empty."""
    start = _first_parting(view, group, seq, ranks) or seq
    here = {r: view.event(r, group, start) for r in ranks}
    if any(e is None or e.call_site is None for e in here.values()):
        return None
    held = [r for r, e in here.items() if _phase(e) not in ("forward", "backward")]
    others = [r for r, e in here.items() if _phase(e) == "backward"]
    if not held or not others or len(held) + len(others) != len(ranks):
        return None
    ref = here[others[0]]
    ref_site = ref.call_site.where if ref.call_site is not None else None
    if len({(here[r].op, here[r].call_site.where, here[r].step) for r in others}) > 1:
        return None
    passes = {_passes_begun(view, r, here[r]) for r in ranks}
    if len(passes) > 1 or passes == {0} or len({e.step for e in here.values()}) > 1:
        return None
    for r in held:
        e = here[r]
        before = view.events(r, group, before=start)
        since = before[-1].time if before else float("-inf")
        ends = [b.time for b in view.evidence(r, "backward_end") if since < b.time < e.time]
        begun = max((b.time for b in view.evidence(r, "backward_begin") if b.time < e.time), default=None)
        if not ends or begun is None:
            return None
        mine = [x for x in before if x.time > begun and _phase(x) == "backward"]
        if not any(x.op == ref.op and x.call_site is not None and x.call_site.where == ref_site for x in mine):
            return None
    return held, others


def _phase(e: CollectiveEvent) -> str:
    return e.phase.value if hasattr(e.phase, "value") else str(e.phase)


def _passes_begun(view: RunView, rank: int, e: CollectiveEvent) -> int:
    """Backward passes the rank began in ``e``'s step before issuing ``e``."""
    return sum(1 for b in view.evidence(rank, "backward_begin", step=e.step) if b.time < e.time)


def held_back_finding(view: RunView, div: Divergence, held_others: tuple[list[int], list[int]], made):
    """``Mechanism.DIFFERENT_OP`` for ``_held_back_pass``'s reading."""
    held, others = held_others
    group = div.group.name
    start = _first_parting(view, group, div.seq, sorted(held + others)) or div.seq
    here = {r: view.event(r, group, start) for r in held + others}
    return made(
        Mechanism.DIFFERENT_OP,
        held,
        f"{rank_names(held)} ended the backward pass with fewer reductions from {_what(here, others)} and issued "
        f"{_what(here, held)} at #{start}, where {rank_names(others)}, in the same backward pass, issued "
        f"{_what(here, others)}: gradient reductions held back past a collective issued after the pass",
        seq=start,
        sites=_sites(here),
    )


def _held_back(view: RunView, rank: int, event, start: int, history: list, at: int, n: int) -> bool:
    """Every collective the rank went past is one the history issues during a backward pass, and the
    rank ran a backward pass since its previous collective: gradient reductions held back to be
    issued later (hooks, buckets, a deferred sync), not left out; what it issued meanwhile is a
    reordering."""
    phases = _phases(view, rank, event.group.name, start, at, n) if event is not None else []
    if not phases or any(p != "backward" for p in phases):
        return False
    before = view.events(rank, event.group.name, before=start)
    since = before[-1].time if before else float("-inf")
    return any(since < b.time < event.time for b in view.evidence(rank, "backward_begin"))


def _phases(view: RunView, rank: int, group: str, start: int, at: int, n: int) -> list[str]:
    """The phases of the history's collectives ``at .. at+n`` (the rank's own stream before ``start``)."""
    events = _recent(view, rank, group, start)
    return [e.phase.value if hasattr(e.phase, "value") else str(e.phase) for e in events[at : at + n]]


def _sites(events: dict) -> dict[int, str]:
    return {r: e.call_site.where for r, e in events.items() if e is not None and e.call_site is not None}


def _previous_step(view: RunView, rank: int, e: CollectiveEvent, whole: bool = False) -> list[CollectiveEvent] | None:
    """The rank's collectives of its previous step on the group from the position ``e`` holds in its
    own step (None: no previous step)."""
    mine = view.events(rank, e.group.name, before=e.seq + 1)
    this = [x for x in mine if x.step == e.step]
    prev = [x for x in mine if x.step == e.step - 1]
    k = len(this) - 1
    if whole:
        return prev
    if not prev or k >= len(prev):
        return None
    return prev[k:]


def _what(events: dict, ranks) -> str:
    e = next((events[r] for r in ranks if events.get(r) is not None), None)
    if e is None:
        return "nothing"
    return f"{e.op} from {short_site(e.call_site.where if e.call_site else None)}"


def _missing(view: RunView, div: Divergence, present: dict, edges: list[WaitEdge], made) -> MechanismFinding:
    missing = tuple(div.missing) or tuple(r for r, v in div.per_rank.items() if v is None)
    waiting = sorted(present)
    v = next(iter(present.values()), None)
    op = f"{v.op} #{div.seq} ({short_site(v.call_site)})" if v else f"#{div.seq}"
    roots = chain_roots(edges, missing) or list(missing)
    states = {r: rank_state(view, r) for r in roots}
    bad = [r for r, s in states.items() if s in (RankState.STOPPED, RankState.CRASHED)] or [
        r for r, s in states.items() if s == RankState.DEAD and view.died(r)
    ]
    if bad:
        state = states[bad[0]]
        return made(
            Mechanism.RANK_OUTSIDE,
            bad,
            f"{rank_names(waiting)} wait in {op} for {rank_names(bad)}, {state.value} outside any collective",
            state=state,
        )
    group = div.group.name
    if any(s == RankState.WORKING for s in states.values()):
        # A rank the others wait for is running its own code: whatever the others issued, it may
        # still come (busy is not an extra collective).
        working = [r for r, s in states.items() if s == RankState.WORKING]
        return made(
            Mechanism.RANK_OUTSIDE,
            working,
            f"{rank_names(waiting)} wait in {op} for {rank_names(working)}, running outside any collective",
            state=RankState.WORKING,
        )
    if v is not None and all(view.finished(r) for r in missing):
        return made(
            Mechanism.EXTRA_COLLECTIVE,
            waiting,
            f"{rank_names(waiting)} issued {op} after {rank_names(missing)} "
            "had ended normally: a collective the others never issue",
        )
    mine = (v.op, v.call_site) if v is not None else None
    seen = {m: _stream_tokens(view, m, group, div.seq) for m in sorted(missing)[:NOVELTY_RANKS]}
    if mine is not None and mine[1] and all(seen.values()) and all(mine not in t for t in seen.values()):
        return made(
            Mechanism.EXTRA_COLLECTIVE,
            waiting,
            f"{rank_names(waiting)} issued {op}, a collective "
            f"{rank_names(missing)} never issued on group {div.group.label()}",
        )
    state = states[roots[0]] if roots else RankState.UNKNOWN
    if any(s == RankState.WORKING for s in states.values()):
        state = RankState.WORKING
    return made(
        Mechanism.RANK_OUTSIDE,
        roots,
        f"{rank_names(waiting)} wait in {op} for {rank_names(roots)}, outside any collective ({state.value})",
        state=state,
    )


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
