"""Where a rank is inside its training step, from its own stream: starting the step's work over, or
closing the step.

A training step issues a sequence of collectives; with gradient accumulation a part of it repeats
once per micro-batch (the forward all-gathers, the per-micro-batch reductions), and a closing part
follows the last micro-batch (the gradient reduce-scatter of the syncing micro-batch, the norm, the
optimizer's collectives, a token-count all-reduce). Comparing a rank's collective at the divergence
with what the same rank issued earlier in the same step tells which part it is in:

- ``restart``: the collective (same op, call site and FSDP unit) was already issued in this step
  and a backward pass ran since: the rank began another pass over the step's repeated part (another
  micro-batch, or the next iteration when it skipped its optimizer step);
- ``closing``: the collective was not issued yet in this step, and the rank ran a backward pass in
  it: it left the repeated part and is closing the step.

The step is the recorder's counter (advanced by the primary optimizer's step hook), the backward
passes its ``backward`` hook. No names are read.
"""

from __future__ import annotations

import itertools
from collections import Counter
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from moedoctor.analysis.evidence.view import RunView
from moedoctor.events import CollectiveEvent

RESTART, CLOSING = "restart", "closing"


def token(e: CollectiveEvent) -> tuple:
    """What makes two collectives of one rank the same one of its loop: op, call site, FSDP unit."""
    return e.op, None if e.call_site is None else e.call_site.where, e.module


def position(view: RunView, event: CollectiveEvent) -> str | None:
    """``restart``, ``closing`` or None (no backward pass in this step yet, or nothing to tell)."""
    rank, group = event.rank, event.group.name
    earlier = [e for e in view.events(rank, group, before=event.seq) if e.step == event.step]
    backwards = [b.time for b in view.evidence(rank, "backward_begin", event.step) if b.time < event.time]
    if not backwards:
        return None
    same = [e for e in earlier if token(e) == token(event)]
    if same:
        return RESTART if any(t > same[-1].time for t in backwards) else None
    return CLOSING


def another_pass(view: RunView, events: list[CollectiveEvent], positions: dict[int, str | None]) -> bool:
    """The ranks that issued ``events`` (their collectives at one divergence) are in different
    micro-batches: they had begun different numbers of backward passes in the step, or a rank at
    ``restart`` (``positions``) issued again a collective that opens each pass (first issued in the
    step before its first backward pass). A collective issued after each backward pass (a
    per-micro-batch metric) issued again by a rank that has run as many passes as the others does
    not begin another pass."""
    begun = {e.rank: sum(1 for b in view.evidence(e.rank, "backward_begin", e.step) if b.time < e.time) for e in events}
    if len(set(begun.values())) > 1:
        return True
    for e in events:
        if positions.get(e.rank) != RESTART:
            continue
        first = next(
            (x for x in view.events(e.rank, e.group.name, before=e.seq) if x.step == e.step and token(x) == token(e)),
            None,
        )
        backwards = [b.time for b in view.evidence(e.rank, "backward_begin", e.step)]
        if first is not None and backwards and first.time < min(backwards):
            return True
    return False


def usual_pass(view: RunView, event: CollectiveEvent) -> bool:
    """The rank that issued ``event`` begins, with it, a backward pass its step has room for: some
    earlier step of the rank began more backward passes than this step has begun so far, and the
    rank cleared no gradients (``zero_grad``) since its last backward pass. Evidence that a rank
    issuing again a collective of its step's repeated part is in another micro-batch, not in the
    next iteration of a rank that skipped its optimizer step (that one begins a pass its steps never
    ran, or clears the gradients first)."""
    begun = [b.time for b in view.evidence(event.rank, "backward_begin", event.step) if b.time < event.time]
    if not begun:
        return False
    if any(max(begun) < z.time < event.time for z in view.evidence(event.rank, "zero_grad")):
        return False
    earlier = Counter(b.step for b in view.evidence(event.rank, "backward_begin") if b.step < event.step)
    return any(n > len(begun) for n in earlier.values()) or _inside_step(view, event, max(begun))


def _inside_step(view: RunView, event: CollectiveEvent, last_pass: float) -> bool:
    """Every earlier step of the rank (the first one aside: it also holds the setup's collectives)
    opened with the same collective on the event's group, ``event`` is not that collective, and the
    rank has not issued it since its last backward pass began: a rank that skipped its optimizer step
    would begin its next iteration with it, so this rank is still in its step, in another pass."""
    before = view.events(event.rank, event.group.name, before=event.seq)
    by_step: dict[int, CollectiveEvent] = {}
    for e in before:
        by_step.setdefault(e.step, e)
    steps = sorted(s for s in by_step if s < event.step)[1:]
    opening = {token(by_step[s])[:2] for s in steps}
    if len(opening) != 1 or token(event)[:2] in opening:
        return False
    return not any(token(e)[:2] in opening for e in before if e.time > last_pass)


def _backward_windows(view: RunView, rank: int, step: int) -> list[tuple[float, float | None]]:
    """(begin, end) of each backward pass of ``rank`` in ``step``, in order; ``end`` is None when the
    pass was not recorded whole (not ended, or overlapping the next)."""
    begins = sorted(e.time for e in view.evidence(rank, "backward_begin", step))
    ends = sorted(e.time for e in view.evidence(rank, "backward_end", step))
    windows: list[tuple[float, float | None]] = []
    for i, begin in enumerate(begins):
        end = next((t for t in ends if t >= begin), None)
        windows.append((begin, None if end is None or (i + 1 < len(begins) and end > begins[i + 1]) else end))
    return windows


def deferred_sync(view: RunView, event: CollectiveEvent, others, *, habit: bool = True) -> int | None:
    """The backward pass (``n``, from 1, in the event's step) that issues ``event`` on its rank when
    every rank of ``others`` ran that same pass to its end without issuing any collective on the
    group, and the job's earlier steps show that habit (a backward pass without a collective on the
    group, then one with): the ranks disagree on which backward pass synchronises gradients (DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync``), i.e. on which micro-batch is the last. None
    otherwise (a job that syncs in every backward pass and skipped it once had its reductions held
    back, e.g. buckets waiting for a gradient that never came: something else). ``habit=False``
    drops the earlier steps' condition: the pass alone, evidence against another reading, not for
    this one."""
    if event.phase != "backward" or not others:
        return None
    n = _passes(view, event)
    if n < 1:
        return None
    group = event.group.name
    ranks = (event.rank, *others)
    times = {r: sorted(e.time for e in view.events(r, group)) for r in ranks}  # once: view.events sorts

    def per_pass(rank: int, step: int) -> list[int | None]:
        """Collectives on the group in each backward pass of the step (None: not recorded whole)."""
        t = times[rank]
        return [
            None if end is None else bisect_right(t, end) - bisect_left(t, begin)
            for begin, end in _backward_windows(view, rank, step)
        ]

    if not all(len(c := per_pass(r, event.step)) >= n and c[n - 1] == 0 for r in others):
        return None
    if not habit:
        return n  # the pass alone, without the earlier steps' habit (e.g. a hang in the first step)
    for rank in ranks:
        for step in sorted({b.step for b in view.evidence(rank, "backward_begin") if b.step < event.step}):
            counts = per_pass(rank, step)
            if any(c == 0 and any(counts[i + 1 :]) for i, c in enumerate(counts)):
                return n
    return None


@dataclass(frozen=True)
class LoopExit:
    """Ranks that loop over items with one collective call site, a different number of times: at the
    divergence ``looping`` ranks issue the site again while ``left`` ranks already issued something
    else (they ran out of items first)."""

    site: str  # ``file:line`` (``CallSite.where``)
    short: str
    looping: tuple[int, ...]
    left: tuple[int, ...]
    counts: dict  # rank -> collectives from the site in the current run, the divergence's included


def _key(e: CollectiveEvent | None) -> tuple | None:
    """(op, call site): one iteration of a loop over items (the FSDP unit may differ per item)."""
    return None if e is None or e.call_site is None else token(e)[:2]


#: How far before the divergence a loop's end is looked for (same-size collectives of different
#: sites pair silently, so a rank may have left the loop a few collectives before the divergence).
LOOKBACK = 16


def loop_exit(view: RunView, group: str, seq: int, ranks) -> LoopExit | None:
    """Ranks looping over items with one collective (same op and call site) each: at ``seq`` some
    ranks issue it again, the others left the loop after fewer iterations (at ``seq`` or a little
    before, when the first collectives after the loop paired silently with loop iterations)."""
    window = {r: [e for e in view.events(r, group, before=seq + 1) if e.seq > seq - LOOKBACK] for r in ranks}
    keys = {_key(window[r][-1]) for r in ranks if window[r] and window[r][-1].seq == seq} - {None}
    for key in sorted(keys, key=str):
        found = _exit(window, key, seq)
        if found is not None and not _same_pass(view, window, found, seq):
            return found
    return None


def _passes(view: RunView, e: CollectiveEvent) -> int:
    """Backward passes ``e``'s rank began in ``e``'s step up to ``e``."""
    return sum(1 for b in view.evidence(e.rank, "backward_begin", e.step) if b.time <= e.time)


def _same_pass(view: RunView, window: dict, found: LoopExit, seq: int) -> bool:
    """Did every rank that seems to have left the loop go on with a collective in a backward pass of
    the step that the looping ranks had also reached (same step, as many passes begun)? Then it is
    still in the loop that runs the passes (a micro-batch loop issuing the site once per pass): the
    ranks disagree within one iteration (a gradient reduction held back or issued early), not on the
    loop's trip count."""
    here = [window[r][-1] for r in found.looping]
    for r in found.left:
        evs = window[r]
        last = max(i for i, e in enumerate(evs) if e.call_site is not None and e.call_site.where == found.site)
        nxt = evs[last + 1] if last + 1 < len(evs) else None
        if nxt is None or nxt.phase != "backward" or any(h.step != nxt.step for h in here):
            return False
        if _passes(view, nxt) < max(_passes(view, h) for h in here):
            return False
    return True


def _exit(window: dict, key: tuple, seq: int) -> LoopExit | None:
    counts, inside, left = {}, [], []
    ranks = list(window)
    for r in ranks:
        evs = window[r]
        last = max((i for i, e in enumerate(evs) if _key(e) == key), default=None)
        if last is None:
            return None
        n = 0
        for e in reversed(evs[: last + 1]):
            if _key(e) != key or e.step != evs[last].step or e.phase != evs[last].phase:
                # A run within one step: a collective issued once per step is the step loop's. And
                # within one pass: the call site issued again in backward after forward is a re-issue
                # (a recompute), not one more iteration.
                break
            n += 1
        counts[r] = n
        if last == len(evs) - 1 and evs[-1].seq == seq:
            inside.append(r)
        elif all(e.call_site is not None and e.call_site.where != key[1] for e in evs[last + 1 :]):
            left.append(r)  # went on to collectives of other call sites
        else:
            return None
    if not inside or not left or min(counts.values()) < 2:
        return None
    if max(counts[r] for r in left) >= min(counts[r] for r in inside):
        return None
    return LoopExit(key[1], key[1].rsplit("/", 1)[-1], tuple(sorted(inside)), tuple(sorted(left)), counts)


def cycle_loop_exit(view: RunView, cycle) -> tuple[str, LoopExit] | None:
    """A loop exit on one of the groups of a wait-for cycle (the waiting rank's group and seq): ranks
    that ran a per-item loop fewer times went on to another group's collectives and closed the cycle."""
    for edge in cycle or ():
        ranks = (edge.rank, *edge.waits_for)
        found = loop_exit(view, edge.group, edge.seq, ranks)
        if found is not None:
            return edge.group, found
    return None


@dataclass(frozen=True)
class Omission:
    """``rank``'s collectives of this step are the previous step's sequence with ``missing`` items
    left out before the divergence, while the other ranks follow it item by item."""

    rank: int
    step: int
    missing: tuple[CollectiveEvent, ...]  # from the reference (previous step's) sequence


def shape_token(e: CollectiveEvent) -> tuple:
    """``token`` with the input shapes: one collective of a repeated sequence, item by item."""
    return (*token(e), e.in_shapes)


def omission(view: RunView, group: str, seq: int, rank: int, others, context: int = 3) -> Omission | None:
    """Did ``rank`` skip collectives that the ranks issue in a repeated sequence? The last ``context``
    collectives before ``seq`` (which every rank agreed on) are looked up earlier in the first other
    rank's stream; what followed them there is what the others issue now, and ``rank``'s collective
    at ``seq`` appears a few items further: the items in between are the ones it left out."""
    here = view.event(rank, group, seq)
    if here is None or not others:
        return None
    ref = [e for e in view.events(sorted(others)[0], group, before=seq + 1)]
    if len(ref) < context + 2 or ref[-1].seq != seq:
        return None
    tokens = [shape_token(e) for e in ref]
    wanted, mine = tokens[-context - 1 : -1], shape_token(here)
    for j in range(len(tokens) - context - 2, -1, -1):
        if tokens[j : j + context] != wanted:
            continue
        after = j + context
        if tokens[after] != tokens[-1]:
            return None  # the repeated sequence does not continue the same way: no template
        for m in range(1, 33):
            if after + m >= len(tokens) - 1:
                return None
            if tokens[after + m] == mine:
                return Omission(rank, here.step, tuple(ref[after : after + m]))
        return None
    return None


def _run_before(evs: list, end: int, key: tuple) -> int:
    """How many collectives of ``key`` come in a row in ``evs`` just before index ``end``."""
    n = 0
    while end - n - 1 >= 0 and _key(evs[end - n - 1]) == key:
        n += 1
    return n


def period_exit(view: RunView, group: str, seq: int, ranks) -> LoopExit | None:
    """A loop of one collective per iteration (``looped``, one optimizer step each, so no run within
    a step) between two issues of a closing collective that every rank issued at the same position
    before: after the previous close every rank ran the loop ``n`` times; now at ``seq`` some ranks
    issue the closing collective after fewer iterations than the others, which are still in the loop
    (they issue it again). At least two iterations in a row show it is a loop: in the previous period
    (``n``) or, where setup collectives cut that one short, on the ranks that left. E.g. an
    update-epochs loop that one rank leaves early on its local KL, or a partition cut into more
    mini-batches on one rank, each minibatch an optimizer step."""
    at = {r: view.event(r, group, seq) for r in ranks}
    if any(e is None for e in at.values()):
        return None
    keys = {r: _key(e) for r, e in at.items()}
    if None in keys.values() or len(set(keys.values())) != 2:
        return None
    streams = {r: view.events(r, group, before=seq + 1) for r in ranks}
    for close, looped in itertools.permutations(set(keys.values())):
        left = tuple(sorted(r for r in ranks if keys[r] == close))
        inside = tuple(sorted(r for r in ranks if keys[r] == looped))
        counts: dict = {}
        prev: set = set()
        for r in ranks:
            evs = streams[r]
            # This period: the looped collective in a row up to seq (the inside ranks' one included).
            n = _run_before(evs, len(evs) - (1 if r in left else 0), looped)
            start = len(evs) - (1 if r in left else 0) - n
            if start < 1 or _key(evs[start - 1]) != close:
                break
            p = evs[start - 1].seq
            # The previous period: the same loop in a row before that close, as long on every rank.
            prev.add((p, _run_before(evs, start - 1, looped)))
            counts[r] = n
        else:
            if len(prev) != 1:
                continue
            _, full = prev.pop()
            if (
                max(full, min(counts[r] for r in left)) < 2
                or min(counts[r] for r in left) < 1
                or max(counts[r] for r in left) >= min(counts[r] for r in inside)
            ):
                continue  # a rank that ran no iteration skipped the loop; one that ran as many did not leave it
            run = [e for e in streams[inside[0]] if e.seq <= seq][-min(counts[r] for r in inside) :]
            if len({e.step for e in run}) != len(run):
                continue  # iterations within one step: loop_exit's runs, not a loop of optimizer steps
            return LoopExit(looped[1], looped[1].rsplit("/", 1)[-1], inside, left, counts)
    return None
