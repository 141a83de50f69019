"""Level 1, gradient reductions held back past a collective issued after the backward pass
(``held_back_pass``): read as a ``different-op``, before the loop exit and the alignment.
"""

from __future__ import annotations

from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.alignment import first_parting, ops_of, sites_of
from moedoctor.analysis.mechanisms.vocabulary import Mechanism
from moedoctor.analysis.model import Divergence
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names


def held_back_pass(view: RunView, group: str, seq: int, ranks: list[int]) -> tuple[list[int], list[int]] | None:
    """(held, others) where, at the first position the ranks part, the ``held`` ranks' backward pass
    ended since their previous collective on the group and they issued a collective outside forward
    and backward, while the ``others``, in the same backward pass of the same step (as many passes
    begun in it), issued a collective from a call site the held ranks issued during their own pass:
    the held ranks' pass issued fewer of the gradient reductions it issues (held back to a later
    flush, hooks that did not fire), and what they issued next lands where the others' reduction is.
    None: any rank fits neither side, or a side is empty."""
    start = first_parting(view, group, seq, ranks) or seq
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
    """``Mechanism.DIFFERENT_OP`` for ``held_back_pass``'s reading."""
    held, others = held_others
    group = div.group.name
    start = first_parting(view, group, div.seq, sorted(held + others)) or div.seq
    here = {r: view.event(r, group, start) for r in held + others}
    return made(
        Mechanism.DIFFERENT_OP,
        held,
        f"{rank_names(held)} ended the backward pass with fewer reductions from {ops_of(here, others)} and issued "
        f"{ops_of(here, held)} at #{start}, where {rank_names(others)}, in the same backward pass, issued "
        f"{ops_of(here, others)}: gradient reductions held back past a collective issued after the pass",
        seq=start,
        sites=sites_of(here),
    )
