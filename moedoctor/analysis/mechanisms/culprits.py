"""Which ranks broke the sequence, and why we think so.

The rules, in order (the first that singles out a proper subset of the ranks wins):

1. Missing: ranks that never issued the collective the others wait in are the culprits, or, when
   they themselves wait in another group, the ranks at the end of that chain of waits; but when
   they finished normally, the ranks that issued it (an extra collective) are.
2. Minority: with more than two members, the ranks outside a strict majority that did the same
   thing.
3. Own steps: the rank whose collective breaks the per-step pattern of its own earlier steps (the
   k-th collective of this step differs from the k-th of its previous step).
4. Own period: the rank whose collective breaks the repeating pattern of its own recent ops (a
   per-key loop in a checkpoint save has no earlier step to compare with).
5. Root: in a broadcast every member issued from one call site with one root, in other sizes, the
   ranks whose size differs from the root's (the root's tensor is what travels).

Nothing here depends on file order: ranks are compared by what they did, ties stay undecided.
"""

from __future__ import annotations

from dataclasses import dataclass

from moedoctor.analysis.model import Divergence, DivergenceKind, WaitEdge
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.waitfor import chain_roots
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names

_END = object()  # the rank's previous step ended here: no collective was due
_UNKNOWN = object()  # no earlier step to compare with


@dataclass(frozen=True)
class Culprits:
    ranks: tuple[int, ...]
    reasoning: str
    rule: str  # "missing", "extra", "minority", "own-steps", "own-period", "root", "cycle", "none"


def find_culprits(
    view: RunView, div: Divergence | None, edges: list[WaitEdge], cycle: list[WaitEdge] | None
) -> Culprits:
    if cycle:
        return _cycle_culprits(view, cycle)
    if div is None:
        return Culprits((), "no divergence between ranks", "none")
    if div.kind == DivergenceKind.STALLED:
        return Culprits(
            (),
            f"every rank of group {div.group.label()} is inside the same collective "
            f"#{div.seq}: no rank broke the sequence",
            "none",
        )
    if div.kind == DivergenceKind.MISSING or (div.kind == DivergenceKind.P2P and div.missing):
        return _missing(view, div, edges)
    found = _minority(div)
    if found is not None:
        return found
    for rule in (_own_steps, _own_period, _own_site, _off_root):
        found = rule(view, div)
        if found is not None:
            return found
    return Culprits(
        (),
        "undetermined: the ranks split evenly and none of them broke a pattern of its own earlier collectives",
        "none",
    )


_names = rank_names


def _missing(view: RunView, div: Divergence, edges: list[WaitEdge]) -> Culprits:
    present = sorted(r for r, v in div.per_rank.items() if v is not None)
    op = next(v for v in div.per_rank.values() if v is not None)
    if all(view.finished(r) for r in div.missing):
        # The others ended normally: the collective they never issued is the extra one.
        return Culprits(
            tuple(present),
            f"{_names(present)} issued {op.op} #{div.seq} of group {div.group.label()} "
            f"after {_names(div.missing)} had finished normally: an extra collective "
            "the others never issue",
            "extra",
        )
    roots = chain_roots(edges, div.missing)
    group = div.group.name
    lasts = []
    for r in div.missing:
        if div.kind == DivergenceKind.P2P:
            continue
        n = view.last_seq(r, group)
        e = view.event(r, group, n)
        state = (
            ""
            if e is None
            else ((", completed" if e.completed is not None else ", not completed") + view.completion_note(r, e))
        )
        lasts.append(
            f"{_names([r])}'s last collective there is #{n}{state}" if n else f"{_names([r])} issued none there"
        )
    why = (
        f"{_names(div.missing)} never issued {op.op} #{div.seq} of group {div.group.label()} that "
        f"{_names(present)} {'waits' if len(present) == 1 else 'wait'} in"
    )
    went_past = [
        (e := view.event(r, group, div.seq)) is not None
        and e.completed is not None
        and view.last_seq(r, group) > div.seq
        for r in present
    ]
    if div.kind != DivergenceKind.P2P and all(went_past):
        # The others completed it and went on to their next collective (a collective that failed is
        # recorded completed too, but nothing follows it), so the missing ranks took part: their traces
        # end before their last records were written (a rank stopped or killed within the native
        # recorder's 2 ms buffer).
        why = (
            f"{_names(div.missing)}'s trace ends before {op.op} #{div.seq} of group {div.group.label()}, which "
            f"{_names(present)} completed (so {_names(div.missing)} took part in it, its last records not "
            f"written), and {_names(present)} then {'waits' if len(present) == 1 else 'wait'} for it"
        )
    if lasts:
        why += " (" + "; ".join(lasts) + ")"
    if set(roots) != set(div.missing):
        chain = [e for e in edges if e.rank in div.missing]
        via = "; ".join(
            f"rank {e.rank} waits in {e.op} #{e.seq} of group {e.group} for {_names(e.waits_for)}" for e in chain
        )
        return Culprits(tuple(roots), f"{why}; {via}: the waits end at {_names(roots)}", "missing")
    return Culprits(tuple(div.missing), why, "missing")


def _minority(div: Divergence) -> Culprits | None:
    members = sum(len(c) for c in div.classes)
    if members <= 2 or len(div.classes) < 2:
        return None
    top, second = div.classes[0], div.classes[1]
    if len(top) < 2 or len(top) == len(second):
        return None
    culprits = tuple(sorted(r for c in div.classes[1:] for r in c))
    rep = div.per_rank[top[0]]
    return Culprits(
        culprits,
        f"{len(top)} of {members} ranks issued {rep.op if rep else 'nothing'} at #{div.seq} "
        f"of group {div.group.label()}; {_names(culprits)} broke the sequence every other "
        "rank follows",
        "minority",
    )


def expected_by_steps(view: RunView, rank: int, group: str, seq: int):
    """The signature the rank's previous step had at this position of its step, ``_END`` when that
    step had no more collectives, ``_UNKNOWN`` without an earlier step."""
    prev = view.events(rank, group, before=seq)
    actual = view.event(rank, group, seq)
    current = actual.step if actual is not None else (prev[-1].step if prev else None)
    if current is None:
        return _UNKNOWN, None
    earlier = [e for e in prev if e.step < current]
    if not earlier:
        return _UNKNOWN, None
    ref_step = max(e.step for e in earlier)
    ref = [e for e in earlier if e.step == ref_step]
    k = sum(1 for e in prev if e.step == current)
    return (ref[k] if k < len(ref) else _END), (current, ref_step, k)


def broke_own_steps(view: RunView, rank: int, group: str, seq: int) -> bool | None:
    expected, _ = expected_by_steps(view, rank, group, seq)
    if expected is _UNKNOWN:
        return None
    actual = view.event(rank, group, seq)
    if actual is None:
        return expected is not _END
    return expected is _END or actual.signature() != expected.signature()


def _own_steps(view: RunView, div: Divergence) -> Culprits | None:
    group = div.group.name
    verdicts = {r: broke_own_steps(view, r, group, div.seq) for r in div.per_rank}
    broke = sorted(r for r, v in verdicts.items() if v)
    kept = sorted(r for r, v in verdicts.items() if v is False)
    if not broke or not kept:
        return None
    r = broke[0]
    expected, where = expected_by_steps(view, r, group, div.seq)
    actual = view.event(r, group, div.seq)
    current, ref_step, k = where
    due = "no collective (its step had ended)" if expected is _END else _op_text(expected)
    did = "nothing" if actual is None else _op_text(actual)
    its = "its" if len(broke) == 1 else "their"
    return Culprits(
        tuple(broke),
        f"{_names(broke)} broke the per-step pattern of {its} own earlier steps: "
        f"collective {k + 1} of step {current} on group {div.group.label()} "
        f"is {did} where step {ref_step} had {due}; {_names(kept)} kept to "
        f"{'its' if len(kept) == 1 else 'their'} pattern",
        "own-steps",
    )


_ROOT_SENDS = ("broadcast",)


def _off_root(view: RunView, div: Divergence) -> Culprits | None:
    """A broadcast that every member issued from one call site with one root, in other sizes: the
    root's tensor is what travels, so the ranks whose size differs from the root's are the ones
    that deviate from what their peers assume."""
    events = {r: view.event(r, div.group.name, div.seq) for r in div.per_rank}
    if any(e is None for e in events.values()):
        return None
    first = next(iter(events.values()))
    assert first is not None
    if first.op not in _ROOT_SENDS or first.root is None or first.root not in events:
        return None
    site = first.call_site.where if first.call_site else None
    if site is None or any(
        e is None or e.op != first.op or e.root != first.root or (e.call_site.where if e.call_site else None) != site
        for e in events.values()
    ):
        return None
    root = events[first.root]
    assert root is not None
    off = tuple(sorted(r for r, e in events.items() if e is not None and e.in_shapes != root.in_shapes))
    if not off or len(off) == len(events):
        return None
    return Culprits(
        off,
        f"every rank issued {first.op} #{div.seq} of group {div.group.label()} from {site.rsplit('/', 1)[-1]} with "
        f"root {first.root}; {_names(off)} posted other sizes than the root sends",
        "root",
    )


def _own_site(view: RunView, div: Divergence) -> Culprits | None:
    """Every member issued the same op from one call site, in other sizes or dtypes: the ranks whose
    collective differs from every earlier one of theirs from that site (each rank's earlier ones all
    alike) changed, the ranks whose collective is the same as before kept to it. Read where the
    steps cannot be compared position by position (a first step that also holds the setup's
    collectives, steps of different lengths)."""
    group = div.group.name
    events = {r: view.event(r, group, div.seq) for r in div.per_rank}
    if any(e is None or e.call_site is None for e in events.values()):
        return None
    keys = {(e.op, e.call_site.where) for e in events.values() if e is not None and e.call_site is not None}
    if len(keys) != 1:
        return None
    op, site = keys.pop()
    broke: list[int] = []
    kept: list[int] = []
    for r, e in events.items():
        assert e is not None
        before = {
            x.signature()
            for x in view.events(r, group, before=div.seq)
            if x.op == op and x.call_site is not None and x.call_site.where == site
        }
        if len(before) != 1:
            return None  # no earlier one, or earlier ones of several sizes: no habit to keep or break
        (kept if e.signature() in before else broke).append(r)
    if not broke or not kept:
        return None
    first = events[broke[0]]
    assert first is not None
    its = "its" if len(broke) == 1 else "their"
    return Culprits(
        tuple(sorted(broke)),
        f"{_names(broke)} issued {_op_text(first)} where every earlier {op} of {its} from that call site "
        f"had the sizes and dtypes that {_names(kept)} still issued",
        "own-site",
    )


def _op_text(e: CollectiveEvent) -> str:
    site = f" from {e.call_site.short}" if e.call_site else ""
    return f"{e.op} {list(map(list, e.in_shapes))}{site}"


def own_period(ops: list[str], min_span: int = 6) -> int | None:
    """The smallest period the tail of ``ops`` repeats with, over at least ``max(2p, min_span)`` ops."""
    n = len(ops)
    for p in range(1, n // 2 + 1):
        span = max(2 * p, min_span)
        if span + p > n:
            break
        if all(ops[n - 1 - i] == ops[n - 1 - i - p] for i in range(span)):
            return p
    return None


def broke_own_period(view: RunView, rank: int, group: str, seq: int) -> tuple[bool | None, int | None, list[str]]:
    prev = view.events(rank, group, before=seq)[-256:]
    # Only a contiguous run of sequence numbers is a history (a windowed trace may have gaps).
    run: list[CollectiveEvent] = []
    for e in reversed(prev):
        if run and run[-1].seq != e.seq + 1:
            break
        run.append(e)
    ops = [e.op for e in reversed(run)]
    p = own_period(ops)
    if p is None or (run and run[0].seq != seq - 1):
        return None, None, ops
    actual = view.event(rank, group, seq)
    return (actual is None or actual.op != ops[-p]), p, ops


def _own_period(view: RunView, div: Divergence) -> Culprits | None:
    group = div.group.name
    verdicts = {r: broke_own_period(view, r, group, div.seq) for r in div.per_rank}
    broke = sorted(r for r, v in verdicts.items() if v[0])
    kept = sorted(r for r, v in verdicts.items() if v[0] is False)
    if not broke or not kept:
        return None
    _, p, ops = verdicts[broke[0]]
    actual = view.event(broke[0], group, div.seq)
    its = "its" if len(broke) == 1 else "their"
    return Culprits(
        tuple(broke),
        f"{_names(broke)} broke the repeating pattern of {its} "
        f"own recent collectives on group {div.group.label()} (period {p}: "
        f"{', '.join(ops[-p:])}): {'nothing' if actual is None else actual.op} where "
        f"{ops[-p]} was due; {_names(kept)} kept to it",
        "own-period",
    )


def broke_own_order(view: RunView, rank: int, group: str, seq: int) -> bool | None:
    """Like ``broke_own_steps``, over the rank's collectives of every group in issue order: does the
    collective it is stuck at sit where its previous step had the same group and op?"""
    target = view.event(rank, group, seq)
    if target is None:
        return None
    events = [e for e in view.rank_events(rank) if not e.is_p2p]
    prev = [e for e in events if e.event_id < target.event_id]
    earlier = [e for e in prev if e.step < target.step]
    if not earlier:
        return None
    ref_step = max(e.step for e in earlier)
    ref = [e for e in earlier if e.step == ref_step]
    k = sum(1 for e in prev if e.step == target.step)
    if k >= len(ref):
        return True
    return (ref[k].group.name, ref[k].signature()) != (target.group.name, target.signature())


def _cycle_culprits(view: RunView, cycle: list[WaitEdge]) -> Culprits:
    ranks = sorted({e.rank for e in cycle})
    verdicts = {e.rank: broke_own_order(view, e.rank, e.group, e.seq) for e in cycle}
    broke = sorted(r for r, v in verdicts.items() if v)
    kept = sorted(r for r, v in verdicts.items() if v is False)
    groups = sorted({e.group for e in cycle})
    if broke and kept:
        return Culprits(
            tuple(broke),
            f"{_names(broke)} issued the collectives of groups {', '.join(groups)} in an "
            f"order {'its' if len(broke) == 1 else 'their'} own earlier steps did not; "
            f"{_names(kept)} kept to the earlier order",
            "cycle",
        )
    return Culprits(
        tuple(ranks),
        f"{_names(ranks)} wait for each other across groups {', '.join(groups)}: "
        "they issue these groups' collectives in opposite orders",
        "cycle",
    )
