"""Level 1 where some members never issued the collective the others wait in (``at_missing``): a
collective no other rank issued, one skipped, or the waited-for ranks outside any collective, with
their state (``rank_state``).
"""

from __future__ import annotations

from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.alignment import NOVELTY_RANKS, stream_tokens
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding, RankState
from moedoctor.analysis.mechanisms.waitfor import chain_roots
from moedoctor.analysis.mechanisms.wording import short_site
from moedoctor.analysis.model import Divergence, WaitEdge
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


def at_missing(view: RunView, div: Divergence, present: dict, edges: list[WaitEdge], made) -> MechanismFinding:
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
    seen = {m: stream_tokens(view, m, group, div.seq) for m in sorted(missing)[:NOVELTY_RANKS]}
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
