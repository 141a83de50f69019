"""The wait-for graph across groups: who waits for whom when the job stops.

A rank waits in its last collective when that collective never completed; it waits *for* the
members of that group (or the p2p peer) that never issued it. A cycle in this graph is a deadlock no
per-group matching can see: every group's own sequence agrees, but rank A waits on group X for B
while B waits on group Y for A (``collective-order-inversion``). Ranks that others wait for and that
wait for nobody are the roots: the hang starts there.
"""

from __future__ import annotations

from moedoctor.analysis.model import WaitEdge
from moedoctor.analysis.evidence.view import RunView
from moedoctor.events import CollectiveEvent


def blocked_event(view: RunView, rank: int) -> CollectiveEvent | None:
    """The collective the rank cannot get past: its earliest issued collective that never completed.

    On a GPU the ops of one stream run in issue order, so a rank whose host went on issuing is still
    stuck at the first incomplete one; on Gloo (blocking) it is the last one issued. Where the run's
    Flight Recorder dumps show collectives pending, the first of those is it. Otherwise functional
    collectives are left out: their completion is observed only through Flight Recorder."""
    if not view.completion_tracked(rank) and not view.hang_declared:
        return None
    trace = view.traces.get(rank)
    if trace is not None and trace.fr_pending:
        for e in view.rank_events(rank):
            if e.completed is None and e.event_id in trace.fr_pending:
                return e
    for e in view.rank_events(rank):
        if e.completed is None and not e.raw_op.startswith("_c10d_functional"):
            return e
    return None


def wait_edges(view: RunView) -> list[WaitEdge]:
    """Who waits for whom: rank A, stuck at collective (X, s), waits for each member B of X that
    never issued (X, s), or issued it only after a collective B is itself stuck at."""
    blocked = {r: blocked_event(view, r) for r in view.ranks}
    edges = []
    for rank in view.ranks:
        e = blocked[rank]
        if e is None:
            continue
        group = e.group.name
        if e.is_p2p:
            peer, n = e.peer, e.p2p_seq
            if peer is None or n is None or peer == rank or peer not in view.traces or peer in view.run.open_ended:
                continue
            theirs = view.p2p_peers(group).get(peer, {}).get(rank, {}).get(n)
            if view.last_p2p(peer, group, rank) < n or _behind(blocked.get(peer), theirs):
                edges.append(WaitEdge(rank, group, n, e.op, (peer,)))
            continue
        waits_for = tuple(
            m
            for m in view.traced_members(group)
            if m != rank
            and (view.never_reached(m, group, e.seq) or _behind(blocked.get(m), view.event(m, group, e.seq)))
        )
        if waits_for:
            edges.append(WaitEdge(rank, group, e.seq, e.op, waits_for))
    return edges


def _behind(stuck_at: CollectiveEvent | None, target: CollectiveEvent | None) -> bool:
    """The rank issued ``target`` but is stuck at an earlier collective of another group. (Within
    one group the matching by sequence number already tells; and completions of the last few
    collectives of a group may simply not have been observed before a rank died.)"""
    return (
        stuck_at is not None
        and target is not None
        and stuck_at.group.name != target.group.name
        and stuck_at.event_id < target.event_id
    )


def find_cycle(edges: list[WaitEdge]) -> list[WaitEdge] | None:
    """The shortest cycle of the graph (ties: lowest ranks) as the edges along it, starting at its
    lowest rank; None if the graph has none."""
    out = {e.rank: e for e in edges}
    best: list[WaitEdge] | None = None
    for start in sorted(out):
        # Breadth-first from ``start`` back to ``start``: the shortest cycle through it.
        parents: dict[int, int] = {}
        frontier = [start]
        found = False
        while frontier and not found:
            nxt = []
            for node in frontier:
                for target in sorted(out[node].waits_for):
                    if target == start:
                        parents[start] = node
                        found = True
                        break
                    if target in out and target not in parents and target != start:
                        parents[target] = node
                        nxt.append(target)
                if found:
                    break
            frontier = nxt
        if not found:
            continue
        cycle_nodes = [start]
        node = parents[start]
        while node != start:
            cycle_nodes.append(node)
            node = parents[node]
        cycle_nodes.reverse()  # start -> ... in wait order
        cycle_nodes = [start] + cycle_nodes[:-1]
        cycle = [out[n] for n in cycle_nodes]
        if best is None or (len(cycle), [e.rank for e in cycle]) < (len(best), [e.rank for e in best]):
            best = cycle
    return best


def roots(edges: list[WaitEdge]) -> list[int]:
    """Ranks that others wait for and that wait for no one."""
    waiting = {e.rank for e in edges}
    return sorted({t for e in edges for t in e.waits_for} - waiting)


def chain_roots(edges: list[WaitEdge], ranks: tuple[int, ...]) -> list[int]:
    """The roots reached by following the waits of ``ranks`` (ranks that wait for nobody stay)."""
    out = {e.rank: e for e in edges}
    found: set[int] = set()
    seen: set[int] = set()
    stack = list(ranks)
    while stack:
        r = stack.pop()
        if r in seen:
            continue
        seen.add(r)
        if r in out:
            stack.extend(out[r].waits_for)
        else:
            found.add(r)
    return sorted(found)
