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
is awaited at, on that group, before (the history shows a reordering of collectives every rank
runs); otherwise 0.35, with the ranks that never issued it in the evidence (an inversion at step
0, with no history, is then not named either).

Fix: issue the collectives of overlapping groups in one global order on every rank (or make one of
them asynchronous and wait for both).
"""

from __future__ import annotations

from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns import Context, Finding, Pattern, names


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
            sites.append((f"{e.call_site.file}:{e.call_site.line}", e.call_site.function))
        evidence.append(f"rank {edge.rank} waits in {edge.op} #{edge.seq} of group {view.groups[edge.group].label()} "
                        f"({site}) for {names(edge.waits_for)}, which never issued it")
    groups = sorted({e.group for e in ctx.cycle})
    evidence.append(f"the waits form a cycle across groups {', '.join(groups)}: no single group shows a mismatch")
    site, fn = sites[0] if sites else (None, None)
    # An inversion reorders collectives every rank issues. A collective only some ranks issue (a
    # rank-conditional one, a skipped one) also makes the others wait elsewhere and closes a cycle:
    # claim the inversion only where each awaited rank has issued that call site on that group before.
    unknown = _never_issued(ctx)
    if unknown:
        evidence.extend(unknown)
        evidence.append("score 0.35 instead of 0.95: the history does not show every rank issuing the collectives "
                        "of the cycle, so a collective issued by some ranks only is as likely as a reordering")
        return Finding(0.35, tuple(evidence), suggestion=Suggestion(site, fn, _ADVICE))
    return Finding(0.95, tuple(evidence), suggestion=Suggestion(site, fn, _ADVICE))


def _never_issued(ctx: Context) -> list[str]:
    """For each wait of the cycle, the awaited ranks that never issued a collective from the call
    site the waiting rank is blocked at, on that group, before."""
    view = ctx.view
    found = []
    for edge in ctx.cycle:
        e = view.event(edge.rank, edge.group, edge.seq)
        if e is None or e.call_site is None:
            continue
        where = f"{e.call_site.file}:{e.call_site.line}"
        for m in edge.waits_for:
            if not view.issued_from(m, edge.group, where):
                found.append(f"rank {m} never issued a collective from {e.call_site.short} on group "
                             f"{view.groups[edge.group].label()}, where rank {edge.rank} waits for it")
    return found


_ADVICE = ("Issue the collectives of these overlapping groups in one fixed order on every rank (for example "
           "always the tensor-parallel group before the data-parallel one), or launch both asynchronously and "
           "wait on both.")

PATTERN = Pattern(
    id="collective-order-inversion", title="Collective order inversion across groups", fixes=(), desync=True,
    classify=classify, advice=_ADVICE,
)
