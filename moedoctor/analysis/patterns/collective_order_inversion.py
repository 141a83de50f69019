"""``collective-order-inversion``: two groups' collectives issued in opposite orders.

Mechanism: two process groups over overlapping ranks (tensor- and data-parallel groups of a
DeviceMesh, an expert group and the world) get their collectives in one order on some ranks and in
the other order on the rest. Each group's own sequence agrees, so per-group matching (and Flight
Recorder's analyzer) finds nothing; the ranks wait for each other across groups.

Evidence: a cycle in the wait-for graph: rank A blocked in group X's collective waits for rank B,
which never issued it because it is blocked in group Y's collective waiting for A.

Risk: none of the per-group patterns can produce a cycle; a cycle built from stale completion
state (a collective that did complete but whose completion was not recorded) would be wrong, which
is why only each rank's last collective counts. A collective that only some ranks issue (a
rank-conditional all_reduce on a subgroup, a tensor-parallel all_reduce one rank skipped) closes a
cycle too: the held-out jobs ``logging_subgroup_cond`` and ``mesh_tp_layerdrop`` were named
inversions with 0.95. So the score is 0.95 only when every awaited rank has issued the call site it
is awaited at, on that group, before, or its counterpart (the same op at a sequence number where the
waiting rank issued from that call site: ranks in different roles, a trainer and a rollout engine,
meet each other's broadcasts from their own code every step), so the history shows a reordering of
collectives every rank runs; otherwise 0.35, with the ranks that never issued it in the evidence (an inversion at step
0, with no history, is then not named either).

Culprits: the ranks of the cycle that changed their own order (their last earlier collectives from
the two call sites came the other way round), when some did and some kept theirs. With no habit (an
inversion at the first iteration), the ranks that reached their blocked collective through an ``if``
the other ranks' stacks show they did not take, when some, not all, did. Otherwise every rank of
the cycle. An awaited rank that never issued its call site but is blocked earlier in the same pass
of the loop that reaches it (``source.on_the_way``) is on its way: the cycle is then a reordering
(0.5), and where some ranks' blocked collectives sit under an ``if`` on the rank that the others
passed, those ranks put theirs first (0.6, culprits; held-out corpus 21's data-source prefetch).

Fix: issue the collectives of overlapping groups in one global order on every rank (or make one of
them asynchronous and wait for both).

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 5 variants of `collective-order-inversion/`
(side DCP group, functional buckets, 3 pair groups in a ring, telemetry group, 2x2 mesh): 5/5 named
after the change; culprits 2/5 (the other three invert at their first collectives: no habit). With
the branch rule (the sixth variant, ``streaming_reader_eager_refill``, held out before it), 4/6: the
two left are symmetric schedules (a ring, a parity stagger) where the yaml's culprits are relative to
the order the fix picks, which no stack shows.
Confusions seen before it: cycles at step 0 named `rank-conditional-collective`
(2: the partner's absence read as 'no partner', though it was blocked in another group) and a
DCP-side-group cycle named `uneven-dtensor-allgather` (a checkpoint phase alone named it).
"""

from __future__ import annotations

from moedoctor.analysis.evidence.source import Branch, decision_branch, frames, line_text, on_the_way, rank_guard
from moedoctor.analysis.evidence.steps import cycle_loop_exit
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import DESYNC, SOURCE, Context, Declaration, Finding, Pattern, names


def classify(ctx: Context) -> Finding | None:
    if not ctx.cycle:
        return None
    view = ctx.view
    evidence = []
    sites = []
    for edge in ctx.cycle:
        e = view.last_event[edge.rank]
        site = e.call_site.short if e is not None and e.call_site else "?"
        if e is not None and e.call_site:
            sites.append((e.call_site.where, e.call_site.function))
        evidence.append(
            f"rank {edge.rank} waits in {edge.op} #{edge.seq} of group {view.groups[edge.group].label()} "
            f"({site}) for {names(edge.waits_for)}, which never issued it"
        )
    groups = sorted({e.group for e in ctx.cycle})
    evidence.append(f"the waits form a cycle across groups {', '.join(groups)}: no single group shows a mismatch")
    site, fn = sites[0] if sites else (None, None)
    # An inversion reorders collectives every rank issues. A collective only some ranks issue (a
    # rank-conditional one, a skipped one) also makes the others wait elsewhere and closes a cycle:
    # claim the inversion only where each awaited rank has issued that call site on that group before.
    unknown = _never_issued(ctx)
    looped = cycle_loop_exit(view, ctx.cycle) if unknown else None
    if looped is not None:
        group, ex = looped
        evidence.append(
            f"score 0.2: on group {view.groups[group].label()} {names(ex.looping)} "
            f"{'is' if len(ex.looping) == 1 else 'are'} still in a loop of collectives from {ex.short} "
            f"that {names(ex.left)} left after fewer iterations: a loop run a different number of "
            "times closed the cycle, not a reordering"
        )
        return Finding(0.2, tuple(evidence), suggestion=Suggestion(site, fn, _ADVICE))
    ahead = _on_the_way(ctx) if unknown else []
    if unknown and ahead and len(ahead) == len(unknown):
        # Every rank that never issued the awaited call site is on its way to it in this very pass;
        # the other waits of the cycle are on call sites every rank has used: a reordering.
        evidence.extend(line for line, _ in ahead)
        blocked = _blocked(ctx)
        on_rank = {
            r: g
            for r, (_g, _s, e) in blocked.items()
            if (g := rank_guard(e.call_site.stack)) is not None and g.kind == "if"
        }
        guarded = sorted(on_rank)
        passed = all(
            any(f.file == g.file and f.line > g.line for f in frames(e.call_site.stack) for g in on_rank.values())
            for r, (_g, _s, e) in blocked.items()
            if r not in on_rank
        )
        if guarded and len(guarded) < len(blocked) and passed:
            evidence.append(
                f"{names(guarded)} put {'its' if len(guarded) == 1 else 'their'} collective first under a branch "
                "on the rank, which the other ranks of the cycle passed without taking: "
                f"{'its' if len(guarded) == 1 else 'their'} own order"
            )
            return Finding(0.6, tuple(evidence), culprits=tuple(guarded), suggestion=Suggestion(site, fn, _ADVICE))
        deciders, lines = _decided(blocked)
        evidence.extend(lines)
        return Finding(0.5, tuple(evidence), culprits=tuple(deciders) or None, suggestion=Suggestion(site, fn, _ADVICE))
    if unknown:
        evidence.extend(unknown)
        guards = [
            g
            for edge in ctx.cycle
            if (e := view.event(edge.rank, edge.group, edge.seq)) is not None
            and (g := rank_guard(e.call_site.stack if e.call_site else ())) is not None
        ]
        new = _first_time(ctx)
        if new and len(new) < len(ctx.cycle):
            evidence.append(
                f"score 0.2: {new[0]}, while the other collectives of the cycle were issued before by "
                "every rank: a collective that appeared on some ranks, not a reordering"
            )
            return Finding(0.2, tuple(evidence), suggestion=Suggestion(site, fn, _ADVICE))
        if guards:
            evidence.append(
                f"score 0.2: the collective at {guards[0].short} is issued under `{guards[0].kind} "
                f"{guards[0].text}`, a branch on the rank: some ranks never issue it"
            )
            return Finding(0.2, tuple(evidence), suggestion=Suggestion(site, fn, _ADVICE))
        evidence.append(
            "score 0.45 instead of 0.95: every rank of the cycle is blocked in a collective and none is "
            "under a branch on the rank, but the history does not show every rank issuing the "
            "collectives of the cycle (a collective that only some ranks issue cannot be ruled out)"
        )
        # Either way (a reordering, or a collective only some ranks issue), the rank whose own branch
        # put its collective there made the decision.
        deciders, lines = _decided(_blocked(ctx))
        evidence.extend(lines)
        return Finding(
            0.45, tuple(evidence), culprits=tuple(deciders) or None, suggestion=Suggestion(site, fn, _ADVICE)
        )
    deviators, habit = _deviators(ctx)
    evidence.extend(habit)
    return Finding(0.95, tuple(evidence), culprits=tuple(deviators) or None, suggestion=Suggestion(site, fn, _ADVICE))


def _deviators(ctx: Context) -> tuple[list[int], list[str]]:
    """The ranks of the cycle that changed their own order: each is blocked at one call site while
    another rank of the cycle is blocked at a second one; if this rank's last earlier collectives from
    the two sites came in the other order, it reordered them now. Named only when some, not all, did
    (a cycle where every rank kept its habit, or none has one, leaves the culprits to the cycle)."""
    view = ctx.view
    blocked = _blocked(ctx)
    changed, kept, lines = [], [], []
    for rank, (group, site, event) in blocked.items():
        other = next(((g, s) for r, (g, s, _) in blocked.items() if r != rank and (g, s) != (group, site)), None)
        if other is None:
            continue
        mine = [x for x in view.events(rank, group, before=event.seq) if x.call_site and x.call_site.where == site]
        theirs = [
            x
            for x in view.events(rank, other[0])
            if x.call_site and x.call_site.where == other[1] and x.event_id < event.event_id
        ]
        if not mine or not theirs:
            continue
        if theirs[-1].event_id < mine[-1].event_id:
            changed.append(rank)
            first, then = site.rsplit("/", 1)[-1], other[1].rsplit("/", 1)[-1]
            lines.append(
                f"rank {rank} issued {first} before {then} this time, after the other order the time "
                "before: it changed its order"
            )
        else:
            kept.append(rank)
    if changed and kept:
        return sorted(changed), lines
    if changed:
        return [], []
    return _decided(blocked)


def _blocked(ctx: Context) -> dict:
    """rank -> (group, call site, event) of each rank's blocked collective in the cycle."""
    blocked = {}
    for edge in ctx.cycle:
        e = ctx.view.event(edge.rank, edge.group, edge.seq)
        if e is not None and e.call_site is not None:
            blocked[edge.rank] = (edge.group, e.call_site.where, e)
    return blocked


def _decided(blocked: dict) -> tuple[list[int], list[str]]:
    """With no habit to break (the cycle at the ranks' first collectives): the ranks that reached their
    blocked collective through an ``if`` the others' stacks show they did not take (a rank-local
    decision, ``source.decision_branch`` confirmed by the other call sites' stacks), when some, not
    all, ranks of the cycle did."""
    taken: dict[int, Branch] = {}
    for rank, (_group, site, event) in blocked.items():
        others = tuple(e.call_site.stack for r, (_g, s, e) in blocked.items() if r != rank and s != site)
        branch = decision_branch(event.call_site.stack, others, confirmed=True) if others else None
        if branch is not None:
            taken[rank] = branch
    if not taken or len(taken) == len(blocked):
        return [], []
    return sorted(taken), [
        f"rank {rank} reached its collective through `if {b.test}` ({b.short}), which the other ranks of "
        "the cycle did not take: a decision of its own put that collective first"
        for rank, b in sorted(taken.items())
    ]


def _first_time(ctx: Context) -> list[str]:
    """The waits of the cycle whose collective its waiting rank issues from that call site for the
    first time on that group."""
    view = ctx.view
    found = []
    for edge in ctx.cycle:
        e = view.event(edge.rank, edge.group, edge.seq)
        if e is None or e.call_site is None:
            continue
        if not view.issued_from(edge.rank, edge.group, e.call_site.where, before=edge.seq):
            found.append(
                f"rank {edge.rank} issues {e.op} from {e.call_site.short} on group "
                f"{view.groups[edge.group].label()} for the first time"
            )
    return found


def _unissued(ctx: Context):
    """(edge, its waiting rank's event, an awaited rank) for each awaited rank of the cycle that never
    issued, on that group before, a collective from the call site the waiting rank is blocked at, nor
    its counterpart: the same op, at a sequence number where the waiting rank issued from that call
    site (ranks in different roles, a trainer's broadcast met by a rollout engine's from its own
    code, pair different call sites every step)."""
    view = ctx.view
    for edge in ctx.cycle:
        e = view.event(edge.rank, edge.group, edge.seq)
        if e is None or e.call_site is None:
            continue
        for m in edge.waits_for:
            if (
                not view.issued_from(m, edge.group, e.call_site.where)
                and not _counterpart(view, edge.group, edge.rank, e, m)
                and not _twin(view, edge.group, e, m)
            ):
                yield edge, e, m


def _twin(view, group: str, e, m: int) -> bool:
    """``m`` issued on the group before ``e``'s op with ``e``'s sizes from another line of the same file
    that reads the same (``dist.all_reduce(t, group=g)`` written in both arms of an ``if`` whose arms
    order the groups differently): the same collective reached by another path, not a new one."""
    site = e.call_site
    text = line_text(site.file, site.line)
    if not text:
        return False
    return any(
        x.call_site is not None
        and x.call_site.file == site.file
        and x.call_site.line != site.line
        and x.op == e.op
        and x.in_shapes == e.in_shapes
        and line_text(x.call_site.file, x.call_site.line) == text
        for x in view.events(m, group, before=e.seq)
    )


def _counterpart(view, group: str, waiter: int, e, m: int) -> bool:
    """``m`` issued ``e``'s op on the group at an earlier sequence number where ``waiter`` issued it
    from ``e``'s call site: it met that call site before, from its own code."""
    mine = view.seq_map(m, group)
    return any(
        x.call_site is not None
        and x.call_site.where == e.call_site.where
        and x.op == e.op
        and (y := mine.get(s)) is not None
        and y.op == e.op
        for s, x in view.seq_map(waiter, group).items()
        if s < e.seq
    )


def _on_the_way(ctx: Context) -> list[tuple[str, int]]:
    """For each of ``_unissued``'s awaited ranks whose own blocked collective's stack shows it earlier in
    the same pass of the loop that issues that call (``source.on_the_way``): (evidence line, rank)."""
    view = ctx.view
    found = []
    for edge, e, m in _unissued(ctx):
        theirs = view.last_event.get(m)
        way = on_the_way(e.call_site.stack, theirs.call_site.stack) if theirs and theirs.call_site else None
        if way is not None:
            behind, ahead, loop = way
            found.append(
                (
                    f"rank {m} never issued a collective from {e.call_site.short} on group "
                    f"{view.groups[edge.group].label()} before, but it is blocked at {behind.short}, earlier "
                    f"in the same pass of the loop at {loop.short} that reaches it at {ahead.short}",
                    m,
                )
            )
    return found


def _never_issued(ctx: Context) -> list[str]:
    """``_unissued``, as evidence lines."""
    return [
        f"rank {m} never issued a collective from {e.call_site.short} on group "
        f"{ctx.view.groups[edge.group].label()}, where rank {edge.rank} waits for it"
        for edge, e, m in _unissued(ctx)
    ]


_ADVICE = (
    "Issue the collectives of these overlapping groups in one fixed order on every rank (for example "
    "always the tensor-parallel group before the data-parallel one), or launch both asynchronously and "
    "wait on both."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------

DECLARATION = Declaration("collective-order-inversion", DESYNC, (), SOURCE)

PATTERN = Pattern(
    id="collective-order-inversion",
    title="Collective order inversion across groups",
    fixes=(),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
