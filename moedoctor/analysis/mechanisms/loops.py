"""Level 1, a loop of one call site run a different number of times (``loop-trip-count``), and the
runs that look like one but are not: a pass of the loop begun again after the items every earlier
pass issued (``pass_restarted``: what follows the loop was skipped), a per-unit loop missing a unit in
the middle (``unit_skipped``), a walk whose items issue one of two collectives (``alternating``).
"""

from __future__ import annotations

from moedoctor.analysis.evidence.steps import LoopExit, token
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.wording import short_site
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names


def _unit_run(view: RunView, rank: int, group: str, seq: int, site: str) -> list[CollectiveEvent]:
    """The rank's last run (one step, one phase) of collectives from ``site`` on ``group`` up to ``seq``."""
    evs = view.events(rank, group, before=seq + 1)
    last = max((i for i, e in enumerate(evs) if e.call_site is not None and e.call_site.where == site), default=None)
    if last is None:
        return []
    run: list[CollectiveEvent] = []
    for e in reversed(evs[: last + 1]):
        if token(e)[:2] != token(evs[last])[:2] or e.step != evs[last].step or e.phase != evs[last].phase:
            break
        run.append(e)
    return run[::-1]


def unit_skipped(view: RunView, group: str, seq: int, exit_: LoopExit) -> tuple[int, list[str], str] | None:
    """A loop exit whose iterations are each another FSDP unit (every collective of the run names a
    unit, none twice), where every rank that "left" issued a unit that the looping ranks issued
    only after one it never issued in the run: it left out that unit in the middle of the sequence
    and went on with the next ones. "The same collective" includes the FSDP unit, so this is a
    skipped collective. A rank whose units are a prefix of the others' (it stopped early) stays a
    loop exit. Returns (the position where the units first differ, the units left out, the unit it
    went on with), or None."""
    runs = {r: _unit_run(view, r, group, seq, exit_.site) for r in (*exit_.looping, *exit_.left)}
    units = {r: [e.module for e in run] for r, run in runs.items()}
    if any(not u or None in u or len(set(u)) != len(u) for u in units.values()):
        return None
    ref = units[exit_.looping[0]]
    if any(units[r] != ref for r in exit_.looping[1:]):
        return None
    at: int | None = None
    skipped: list[str] = []
    went_on = ""
    for r in exit_.left:
        mine = units[r]
        i = next((k for k, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        if i is None or mine[i] not in ref[i + 1 :]:
            return None  # a prefix of the others' units, or a unit they never issued: not a skip
        missing = ref[i : ref.index(mine[i])]
        if any(m in mine for m in missing):
            return None  # the left-out unit comes later: another reading (a reordering)
        pos = runs[r][i].seq
        at = pos if at is None else min(at, pos)
        skipped.extend(m for m in missing if m not in skipped)
        went_on = mine[i]
    if at is None:
        return None
    return at, skipped, went_on


def _runs(evs: list[CollectiveEvent], key: tuple) -> list[list[CollectiveEvent]]:
    """The maximal runs of consecutive collectives of ``key`` (op, call site) in ``evs``."""
    runs: list[list[CollectiveEvent]] = []
    for i, e in enumerate(evs):
        if token(e)[:2] != key:
            continue
        if i and token(evs[i - 1])[:2] == key and runs:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def pass_restarted(view: RunView, group: str, seq: int, exit_: LoopExit) -> tuple[int, int, str] | None:
    """A loop exit where the "looping" ranks did not loop longer but began the next pass: the last
    two earlier runs of the loop's collective, on every rank, were the same ``n`` items (the same
    sequence of sizes, at least two different ones), every earlier run followed by the same
    collective; the ranks that "left" issued the ``n`` items and went on with that collective, and
    the looping ranks issued them and then the first items again (the sequence restarted). They
    skipped what every earlier pass issued after the loop. (Where the step counter parts the runs,
    a run is counted within one step and never reaches past ``n``.) Returns (the position of the
    restart, ``n``, the collective the others went on with), or None."""
    ranks = (*exit_.looping, *exit_.left)
    evs = {r: view.events(r, group, before=seq + 1) for r in ranks}
    key = token(evs[exit_.looping[0]][-1])[:2]
    runs = {r: _runs(evs[r], key) for r in ranks}
    if any(len(rs) < 3 for rs in runs.values()):
        return None
    items = [e.in_shapes for e in runs[exit_.looping[0]][-2]]
    n = len(items)
    if n < 2 or len(set(items)) < 2:
        return None
    follow = set()
    for r in ranks:
        earlier = runs[r][:-1]
        if any([e.in_shapes for e in run] != items for run in earlier[-2:]):
            return None
        for run in earlier:
            idx = evs[r].index(run[-1])
            if idx + 1 < len(evs[r]):
                follow.add(token(evs[r][idx + 1])[:2])
    if len(follow) != 1:
        return None
    after = next(iter(follow))
    for r in exit_.left:
        if [e.in_shapes for e in runs[r][-1]] != items:
            return None
        idx = evs[r].index(runs[r][-1][-1])
        if idx + 1 >= len(evs[r]) or token(evs[r][idx + 1])[:2] != after:
            return None
    at: int | None = None
    for r in exit_.looping:
        cur = runs[r][-1]
        if cur[-1] is not evs[r][-1] or len(cur) <= n:
            return None
        shapes = [e.in_shapes for e in cur]
        if shapes[:n] != items or shapes[n:] != items[: len(shapes) - n]:
            return None
        at = cur[n].seq if at is None else min(at, cur[n].seq)
    if at is None:
        return None
    return at, n, f"{after[0]} ({short_site(after[1])})"


def alternating(view: RunView, group: str, seq: int, exit_: LoopExit) -> bool:
    """Is the collective the "left" ranks issued at ``seq`` one that every rank already issued in
    this pass (same step and phase), between items of the loop (the loop's collective issued both
    before and after it)? Then the loop does not issue one collective per iteration: each item
    issues one of the two, and at ``seq`` the ranks took different paths at one item (a
    different op), not a loop that some ranks left."""
    here = [view.event(r, group, seq) for r in exit_.left]
    if any(e is None or e.call_site is None for e in here):
        return False
    nexts = {token(e)[:2] for e in here if e is not None}
    if len(nexts) != 1:
        return False
    other = next(iter(nexts))
    for r in (*exit_.looping, *exit_.left):
        at = view.event(r, group, seq)
        if at is None:
            return False
        evs = [e for e in view.events(r, group, before=seq) if e.step == at.step and e.phase == at.phase]
        marks = [token(e)[:2] for e in evs]
        firsts = [i for i, t in enumerate(marks) if t == other]
        if not firsts or not any(t[1] == exit_.site for t in marks[: firsts[0]]):
            return False
        if not any(t[1] == exit_.site for t in marks[firsts[-1] + 1 :]):
            return False
    return True


def moved_on(view: RunView, rank: int, site: str) -> bool:
    """The rank issued a collective from another call site (any group) after its last one from ``site``."""
    events = view.rank_events(rank)
    last = max((i for i, e in enumerate(events) if e.call_site is not None and e.call_site.where == site), default=None)
    return last is not None and any(e.call_site is None or e.call_site.where != site for e in events[last + 1 :])


def loop_text(exit_: LoopExit) -> str:
    counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(exit_.counts.items()))
    return (
        f"a loop of one collective per iteration at {exit_.short}: {rank_names(exit_.left)} left it after fewer "
        f"iterations while {rank_names(exit_.looping)} went on ({counts})"
    )
