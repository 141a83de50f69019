"""``rank-conditional-collective``: a collective only some ranks issue.

Mechanism: a collective sits inside a rank-dependent branch (``if rank == 0:`` logging, a progress
bar, a ``dist.reduce`` whose result only rank 0 sees and then acts on), so a subset of the ranks
issues an extra collective the others never will.

Evidence: at the divergence, some ranks' collective comes from a call site that the other ranks of
the group never issued a collective from (in everything recorded); the others never reached that
sequence number, or what they issued there is the next collective of the extra ranks (an inserted
op); the extra call site recurs on the extra ranks. The mirror case, an *omission*: some ranks skip a call
site they issued in earlier iterations, what they issue instead is what the others issue next (or
what followed that call site in the iterations every rank ran), and the function leaves early on a
test that reads the rank before the call (``if rank == 1 and ...: continue``); the culprits are the
ranks that skipped. A *repeat*: the call site every rank just issued once (a shared helper such as
``reduce_tensor``), issued again by some ranks only, under a branch on the rank, while the others
went on; a history that issues it twice in a row elsewhere is a loop, not a repeat.

Risk: a rank that merely ran ahead into code the others have not reached yet (the next phase) also
has a call site the others never used; that is why the inserted-op and missing signals weigh more
than the unique call site alone.

Fix: hoist the collective out of the branch (every rank calls it, only one uses the result), or
replace it with a non-collective operation on the one rank.

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 5 variants of `rank-conditional-collective/`
(forward hook on rank 0, DCP save on main only, 2x2 mesh logging, progress-bar callback, STOP file):
4/5. Confusions seen: the hook installed on rank 0 only is left `unknown-desync` (the rank branch is
at the registration, not on the collective's stack); it claimed two step-0 inversions and three
per-key loops that one rank left early, before the cycle and loop-exit checks. On NCCL (2 GPUs, 3 of the
5 variants have 2 ranks) `stop_file_rank0_break` was `unknown-desync`: rank 1 ran on into the next
step's backward, so no inserted-op signal, and the rank test sat on a `break` out of the loop before
the call (now read as a guard: "leaves the loop"). A job that skips an all_reduce under
`if rank == 1 and ...: continue` (tests/jobs/group_setups.py --desync) was `unknown-desync` before the
omission case.
"""

from __future__ import annotations

from moedoctor.analysis.evidence.source import rank_guard
from moedoctor.analysis.evidence.steps import loop_exit, omission, shape_token
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import (
    DESYNC,
    SAME_POSITION,
    SOURCE,
    Context,
    Declaration,
    Finding,
    Pattern,
    names,
)


def _site(e) -> str | None:
    return None if e.call_site is None else e.call_site.where


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind() or ctx.div.kind.value == "p2p":
        return None
    div, view = ctx.div, ctx.view
    group = div.group.name
    present = ctx.present()
    sites = {r: {_site(e) for e in view.events(r, group)} - {None} for r in div.per_rank}
    best = None
    for cls in div.classes:
        ranks = [r for r in cls if r in present]
        if not ranks or present[ranks[0]].call_site is None:
            continue
        site = present[ranks[0]].call_site
        others = [r for r in div.per_rank if r not in cls]
        if not others:
            continue
        if any(site in sites[r] for r in others):
            for found in (_omitted_under_guard(ctx, ranks, others), _repeated_under_guard(ctx, ranks, others)):
                if found is not None and (best is None or found.score > best.score):
                    best = found
            continue
        score = 0.35
        evidence = [
            f"{names(ranks)} issued {present[ranks[0]].op} #{div.seq} of group {div.group.label()} from "
            f"{present[ranks[0]].short_site}, a call site {names(others)} never issued a collective from"
        ]
        next_ops = [view.event(r, group, div.seq + 1) for r in ranks]
        theirs = [ctx.event(r) for r in others]
        in_cycle = bool(ctx.cycle) and any(edge.group == group for edge in ctx.cycle)
        if all(t is None for t in theirs) and in_cycle:
            they = "it is" if len(others) == 1 else "they are"
            evidence.append(
                f"{names(others)} never issued #{div.seq}, but {they} "
                "blocked in a collective of another group (a wait-for cycle): that does not show "
                f"{'it' if len(others) == 1 else 'they'} would never issue it"
            )
        elif all(t is None for t in theirs):
            score += 0.25
            evidence.append(f"{names(others)} never issued #{div.seq}: the extra collective has no partner")
        elif all(n is not None for n in next_ops) and all(
            t is not None and t.signature() == next_ops[0].signature() for t in theirs
        ):
            score += 0.25
            evidence.append(
                f"{names(ranks)}' next collective (#{div.seq + 1}) is what {names(others)} issued at "
                f"#{div.seq}: an op inserted on a subset"
            )
        shared = [t for t in theirs if t is not None and _site(t) in sites[ranks[0]]]
        if theirs and len(shared) == len(theirs):
            score += 0.15
            evidence.append(
                f"what {names(others)} issued there ({shared[0].op} from {shared[0].call_site.short}) is a "
                f"collective {names(ranks)} also issue{'s' if len(ranks) == 1 else ''}: "
                "the extra op shifted "
                f"{'its' if len(ranks) == 1 else 'their'} sequence"
            )
        guard = rank_guard(ctx.stack(ranks[0]))
        if guard is not None:
            score += 0.3
            evidence.append(
                f"the call is made under `{guard.kind} {guard.text}` ({guard.short}), a branch on the "
                "rank: only the ranks that take it issue the collective"
            )
        recurring = sum(1 for e in view.events(ranks[0], group) if _site(e) == site)
        if recurring > 1:
            score += 0.1
            evidence.append(
                f"{present[ranks[0]].short_site} issued {recurring} collectives on rank {ranks[0]}, "
                f"none on {names(others)}"
            )
        exit_ = loop_exit(view, group, div.seq, list(div.per_rank))
        if exit_ is not None and set(exit_.left) == set(ranks):
            score -= 0.3
            evidence.append(
                f"but {names(ranks)} had just left a loop of collectives from {exit_.short} that "
                f"{names(others)} {'is' if len(others) == 1 else 'are'} still in: a loop run a different "
                "number of times, not a collective inserted on some ranks"
            )
        if best is None or score > best.score:
            v = present[ranks[0]]
            best = Finding(
                round(score, 3),
                tuple(evidence),
                culprits=tuple(ranks),
                suggestion=Suggestion(v.call_site, v.function, _ADVICE),
            )
    return best


def _omitted_under_guard(ctx: Context, ranks: list[int], others: list[int]) -> Finding | None:
    """The mirror case: ``others`` skipped a call site they issued before, and the function that
    issues it leaves early on a test that reads the rank (``if rank == 1 and ...: continue``).
    Evidence that the others *omitted* it rather than ran ahead: what they issued at the divergence
    is what ``ranks`` issue next."""
    div, view, present = ctx.div, ctx.view, ctx.present()
    v = present[ranks[0]]
    guard = rank_guard(ctx.stack(ranks[0]))
    if guard is None or not guard.text.endswith("(early exit)"):
        return None
    group = div.group.name
    nxt = view.event(ranks[0], group, div.seq + 1)
    theirs = [ctx.event(r) for r in others]
    if any(t is None for t in theirs):
        return None
    if nxt is not None and all(t.signature() == nxt.signature() for t in theirs):
        how = f"is {names(ranks)}' next collective (#{div.seq + 1})"
    elif all(_skipped(view, group, div.seq, r, ranks, v) for r in others):
        how = f"follows {v.short_site} in the steps every rank ran before"
    else:
        return None
    if loop_exit(view, group, div.seq, list(div.per_rank)) is not None:
        return None  # a loop some ranks left early: a count mismatch, not one skipped call
    before = sum(1 for e in view.events(others[0], group) if e.seq < div.seq and _site(e) == v.call_site)
    their_site = theirs[0].call_site.short if theirs[0].call_site else "an unknown call site"
    evidence = (
        f"{names(others)} skipped {v.op} from {v.short_site} at #{div.seq} of group {div.group.label()}, a call site "
        f"{'it' if len(others) == 1 else 'they'} issued {before} collective(s) from before",
        f"what {names(others)} issued at #{div.seq} ({theirs[0].op} from {their_site}) {how}: an op "
        "omitted on a subset",
        f"the function leaves early under `{guard.text.removesuffix(' (early exit)')}` ({guard.short}), a test on "
        "the rank, before the call",
    )
    return Finding(0.85, evidence, culprits=tuple(others), suggestion=Suggestion(v.call_site, v.function, _ADVICE))


def _repeated_under_guard(ctx: Context, ranks: list[int], others: list[int]) -> Finding | None:
    """The call site every rank just issued, issued again by ``ranks`` only, under a branch on the
    rank (``if rank == 0: validate(soup)`` calling the same helper as the shared validation before
    it), while ``others`` went on: an extra collective on a subset, its call site shared."""
    div, view, present = ctx.div, ctx.view, ctx.present()
    group = div.group.name
    mine = [view.event(r, group, div.seq) for r in ranks]
    before = [view.event(r, group, div.seq - 1) for r in (*ranks, *others)]
    theirs = [ctx.event(r) for r in others]
    if any(e is None for e in (*mine, *before)) or any(t is None for t in theirs):
        return None
    key = shape_token(before[0])
    if any(shape_token(e) != key for e in (*mine, *before)) or any(shape_token(t) == key for t in theirs):
        return None
    earlier = [shape_token(e) for e in view.events(ranks[0], group, before=div.seq - 1)]
    if any(a == b == key for a, b in zip(earlier, earlier[1:] + [key])):
        return None  # the history issues it twice in a row: a loop, not an extra call
    guard = rank_guard(ctx.stack(ranks[0]))
    if guard is None or guard.text.endswith("(early exit)"):
        return None
    v = present[ranks[0]]
    evidence = (
        f"{names(ranks)} issued {v.op} from {v.short_site} at #{div.seq} of group {div.group.label()} a second "
        f"time in a row, where every rank issued it once at #{div.seq - 1} and {names(others)} went on",
        f"the second call is made under `{guard.kind} {guard.text}` ({guard.short}), a branch on the rank: only "
        "the ranks that take it issue the collective",
    )
    return Finding(0.75, evidence, culprits=tuple(ranks), suggestion=Suggestion(v.call_site, v.function, _ADVICE))


def _skipped(view, group: str, seq: int, rank: int, ranks: list[int], v) -> bool:
    """``rank`` left out exactly the collective ``v`` of a sequence the ranks repeated before."""
    for context in (3, 2):
        found = omission(view, group, seq, rank, ranks, context=context)
        if found is not None:
            return len(found.missing) == 1 and _site(found.missing[0]) == v.call_site
    return False


_ADVICE = (
    "Take this collective out of the rank-dependent branch: call it on every rank of the group (only the "
    "rank that needs the result uses it), or do the work locally on that one rank without a collective."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------

DECLARATION = Declaration("rank-conditional-collective", DESYNC | SAME_POSITION, (), SOURCE)

PATTERN = Pattern(
    id="rank-conditional-collective",
    title="Rank-conditional collective",
    fixes=(),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
