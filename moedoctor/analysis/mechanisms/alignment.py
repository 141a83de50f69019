"""Level 1, collectives some ranks skipped or added, read by aligning the ranks' streams on the
history they share up to where they first part (``aligned_finding``, ``left_out``, ``expected_next``), and the
small helpers the other readings share (``sites_of``, ``ops_of``, ``stream_tokens``).
"""

from __future__ import annotations

from moedoctor.analysis.evidence.steps import LOOKBACK, shape_token
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding
from moedoctor.analysis.mechanisms.wording import short_site
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names


#: Ranks whose whole stream is read to call a collective new to them (the first ones, by rank): the
#: claim is made on these, so a 256-rank job costs what an 8-rank one does.
NOVELTY_RANKS = 8


def stream_tokens(view: RunView, rank: int, group: str, before: int) -> set:
    """(op, call site) of every collective the rank issued on the group before ``before``."""
    return {
        (e.op, e.call_site.where if e.call_site else None) for s, e in view.seq_map(rank, group).items() if s < before
    }


#: Longest context (collectives every rank agreed on just before the divergence) looked up in the
#: ranks' shared history, and how far past the expected collective a skipping rank's one is sought.
CONTEXT, AHEAD = 4, 32


#: How much of the shared history is read (the most recent collectives).
HISTORY = 512


def first_parting(view: RunView, group: str, seq: int, ranks: list[int]) -> int | None:
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
    start = first_parting(view, group, seq, ranks)
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
    shared history (``aligned_finding``): rank -> the history's collectives it went past (as the first rank
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
    events = _recent(view, ranks[0], group, start)
    if any(at + n < len(events) and events[at + n].phase != here[r].phase for r, n in skips.items()):
        # The collective it issued is the one the history puts n places further only by its op, call
        # site and shapes: the history issued that one in another phase (forward, backward, outside
        # both), so this is not that occurrence (e.g. a forward's collective issued again in backward).
        return None
    if any(
        _issued_later(view, r, group, start, set(history[at : at + n]))
        or held_back(view, r, here[r], start, history, at, n)
        for r, n in skips.items()
    ):
        return None
    return {r: events[at : at + n] for r, n in skips.items()}


def aligned_finding(view: RunView, group: str, seq: int, ranks: list[int], made) -> MechanismFinding | None:
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
            f"{rank_names(deviating)} issued {ops_of(here, deviating)} at #{start} where "
            f"{rank_names(normal)} issued {ops_of(here, normal)}, as every earlier occurrence of the "
            f"preceding collectives was followed: {rank_names(deviating)} left out "
            f"{n} collective{'s' if n > 1 else ''} the others issue",
            seq=start,
            sites=sites_of(here),
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
                f"{rank_names(repeats)} issued {ops_of(here, repeats)} a second time in a row at #{start}, "
                f"a repeat the earlier collectives never show, while {rank_names(went_on)} went on "
                f"({ops_of(here, went_on)})",
                seq=start,
                sites=sites_of(here),
            )
    return None


def _issued_later(view: RunView, rank: int, group: str, start: int, tokens: set) -> bool:
    """The rank issued one of ``tokens`` after ``start``: it reordered them, it did not leave them out."""
    return any(shape_token(e) in tokens for s, e in view.seq_map(rank, group).items() if s > start)


def held_back(view: RunView, rank: int, event, start: int, history: list, at: int, n: int) -> bool:
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


def sites_of(events: dict) -> dict[int, str]:
    return {r: e.call_site.where for r, e in events.items() if e is not None and e.call_site is not None}


def ops_of(events: dict, ranks) -> str:
    e = next((events[r] for r in ranks if events.get(r) is not None), None)
    if e is None:
        return "nothing"
    return f"{e.op} from {short_site(e.call_site.where if e.call_site else None)}"
