"""Level 1 at a position where every rank issued a collective: the same op with other shapes,
dtypes, reduce op or splits (``same_op``), else the alignment, the step's repeated part run a
different number of times, or different collectives at one position (``at_mismatch``).
"""

from __future__ import annotations

from moedoctor.analysis.evidence.source import same_loop
from moedoctor.analysis.evidence.steps import CLOSING, RESTART, another_pass, position, token, usual_pass
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.alignment import NOVELTY_RANKS, aligned_finding, ops_of, stream_tokens
from moedoctor.analysis.mechanisms.culprits import Culprits
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding
from moedoctor.analysis.mechanisms.wording import short_site
from moedoctor.analysis.model import Divergence
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names


def same_op(div: Divergence, present: dict, culprits: Culprits, made) -> MechanismFinding | None:
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


def at_mismatch(view: RunView, div: Divergence, present: dict, culprits: Culprits, made) -> MechanismFinding:
    group = div.group.name
    aligned = aligned_finding(view, group, div.seq, sorted(present), made)
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
            f"{rank_names(restart)} issued {ops_of(events, restart)} again during a backward pass, a call site "
            f"they issued earlier in this step; {rank_names(closing)} did not and went on ({ops_of(events, closing)})",
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
                f"{rank_names(closing)} issued {ops_of(events, closing)} inside the loop at {loop.short} "
                f"({loop.text}), which {rank_names(restart)} went on with ({ops_of(events, restart)}): "
                "an extra collective within an iteration, not a loop left early",
            )
        return made(
            Mechanism.LOOP_TRIP_COUNT,
            closing,
            f"{rank_names(restart)} began another pass over the step's repeated part "
            f"({ops_of(events, restart)}) while {rank_names(closing)} closed the step ({ops_of(events, closing)})",
        )
    classes = [c for c in div.classes if c and c[0] in present]
    # A collective whose (op, call site) the other side never issued on this group: an extra one.
    novel = []
    for cls in classes:
        mine = token(events[cls[0]])[:2] if events.get(cls[0]) else None
        others = sorted(r for r in present if r not in cls)[:NOVELTY_RANKS]
        if mine is not None and others and all(mine not in stream_tokens(view, o, group, div.seq + 1) for o in others):
            novel.append(cls)
    if len(novel) == 1:
        cls = novel[0]
        return made(
            Mechanism.EXTRA_COLLECTIVE,
            cls,
            f"{rank_names(cls)} issued {ops_of(events, cls)}, a collective "
            f"the other ranks never issued on group {div.group.label()} "
            f"(they issued {ops_of(events, [r for r in present if r not in cls])})",
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
                    f"{rank_names(deviating)} issued {ops_of(events, deviating)} "
                    f"where their own previous step issued {ops_of(events, others)} first, as "
                    f"{rank_names(others)} {'does' if len(others) == 1 else 'do'}: they skipped it",
                )
            if token(e)[:2] not in [token(x)[:2] for x in _previous_step(view, deviating[0], e, whole=True) or []]:
                return made(
                    Mechanism.EXTRA_COLLECTIVE,
                    deviating,
                    f"{rank_names(deviating)} issued {ops_of(events, deviating)}, which their own previous step "
                    f"never issued, where that step, like {rank_names(others)} now, issued {ops_of(events, others)}",
                )
    per = " while ".join(f"{rank_names(c)} issued {ops_of(events, c)}" for c in classes[:3])
    return made(Mechanism.DIFFERENT_OP, deviating, f"at the same position {per}")


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
