"""``straggler``: one rank is stuck outside any collective while the others wait for it.

Mechanism: not a desync. A rank never reaches the next collective because it is stuck in its own
code (a data loader read on a hung mount, a lock, a host-side wait, a long compute); the others
wait in that collective until the timeout. Every collective that was issued matches.

Evidence: the ranks the others wait for (the roots of the wait-for graph) completed their last
collective, and py-spy shows their main thread outside ``torch.distributed``, naming the function
they are stuck in. Without traces (stuck before ``init_process_group``) the stacks alone: some
ranks inside torch.distributed (waiting at rendezvous), others elsewhere.

The straggler that never comes back: a rank that spins (a decode retry, a crop loop) is busy, so
``moedoctor run`` never stops it; the waiting ranks' own collective timeout ends the job and the
awaited rank is torn down with it. On that crash the pattern is named from the busy record that
covers the wait (``outlasted_wait``); a rank that raised or died of its own is not a straggler.

Risk: a rank that skipped a collective and then blocked in user code looks the same; the stack
names the function, which tells them apart. Without a stack the score stays low. A rank whose
process does not run at all (state ``T`` or ``D`` when the hang was diagnosed) is not stuck in its
own code: that is ``rank-stopped``, and this pattern does not claim it.

Fix: none in the collectives; find why that function does not return.

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 5 variants of `straggler/`
(rejection-sampling spin, dead prefetch thread, subprocess prompt, wedged socket, leaked flock):
5/5; the held-out spins that crash on the timeout (corpus 25's Jukebox, corpus 27's Kinetics decode
retry and IoU crop) 0/3 before ``outlasted_wait``, 3/3 after.
"""

from __future__ import annotations

import signal

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.mechanisms.vocabulary import RankState
from moedoctor.analysis.model import DivergenceKind, Suggestion
from moedoctor.analysis.patterns.base import (
    BUSY,
    EXCEPTION,
    EXITS,
    Context,
    Declaration,
    Finding,
    Pattern,
    StackContext,
    StackFinding,
    names,
)


def classify(ctx: Context) -> Finding | None:
    view = ctx.view
    div = ctx.div
    if div is None:
        if not ctx.hang:
            return None
        ranks = sorted(view.run.stacks)
        outside = [r for r in ranks if view.in_distributed(r) is False]
        inside = [r for r in ranks if view.in_distributed(r)]
        if not outside or not inside or any(view.died(r) or view.frozen(r) for r in outside):
            return None
        evidence = [_where(view, r) for r in outside]
        evidence.append(
            f"{names(inside)} {'waits' if len(inside) == 1 else 'wait'} inside torch.distributed "
            f"({view.stack_frame(inside[0])})"
        )
        return Finding(0.7, tuple(evidence), culprits=tuple(outside), suggestion=_suggest(view, outside[0]))
    if not (div.kind == DivergenceKind.MISSING or (div.kind == DivergenceKind.P2P and div.missing)):
        return None
    roots = sorted(ctx.culprits.ranks) or sorted(div.missing)
    if roots and all(view.died(r) for r in roots):
        outlasted = outlasted_wait(ctx)
        if outlasted is None:
            return None
        return Finding(
            0.8, tuple(outlasted), culprits=tuple(roots), suggestion=_suggest(view, roots[0]), explains_crash=True
        )
    if not roots or any(view.died(r) or view.frozen(r) for r in roots):
        return None
    waiting = sorted(r for r, v in div.per_rank.items() if v is not None)
    v = div.per_rank[waiting[0]]
    where = f" ({v.short_site})" if v.short_site else ""
    evidence = [
        f"{names(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in {v.op} #{div.seq} of group "
        f"{div.group.label()}{where} for {names(div.missing)}, which never issued it"
    ]
    inside = [view.in_distributed(r) for r in roots]
    done = []
    for r in roots:
        last = view.last_event.get(r)
        if last is None:
            done.append(True)
            continue
        done.append(last.completed is not None)
        state = ("completed" if last.completed is not None else "did not complete") + view.completion_note(r, last)
        evidence.append(f"rank {r}'s last collective, {last.op} #{last.seq} of group {last.group.name}, {state}")
    if all(i is False for i in inside) and all(done):
        evidence.extend(_where(view, r) for r in roots)
        score = 0.9
    elif all(i is None for i in inside) and all(done):
        # Without a stack, a rank stuck in its own code and a rank that skipped the collective
        # look the same: not enough to name this pattern on its own.
        evidence.append(
            f"no stack of {names(roots)} to show where {'it is' if len(roots) == 1 else 'they are'} "
            "stuck (run with py-spy available)"
        )
        score = 0.35
    else:
        score = 0.2
    return Finding(score, tuple(evidence), culprits=tuple(roots), suggestion=_suggest(view, roots[0]))


#: Of the wait (from the waiting ranks' collective to the first timeout), the share a busy record
#: must cover: its account is refreshed while the silence lasts, the last refresh falls short by one.
COVERED = 0.8
_TEARDOWN = (-signal.SIGTERM, -signal.SIGKILL)


def outlasted_wait(ctx: Context) -> list[str] | None:
    """The straggler that never came back, on the crash path: the ranks the others wait for (who
    never issued the collective) were still working outside any collective when the waiting ranks'
    own collective timeout ended the job. Each of: the waiting ranks raised (their timeout), none of
    the awaited ones did, none is the launcher's first failure and each ended by the launcher's
    teardown (SIGTERM / SIGKILL), not a failure of its own; and a busy record of ``moedoctor run``
    shows the awaited ranks working and the waiting ones waiting for at least ``COVERED`` of the wait
    up to the first timeout. The evidence lines, or None (a rank that crashed or died of its own is
    no straggler; without the busy record nothing shows it was working)."""
    view, div = ctx.view, ctx.div
    if div is None or div.kind != DivergenceKind.MISSING:
        return None
    roots = sorted(ctx.culprits.ranks) or sorted(div.missing)
    waiting = sorted(r for r, v in div.per_rank.items() if v is not None)
    if not roots or not waiting:
        return None
    for r in roots:
        code = view.exit_code(r)
        if view.exception(r) is not None or view.first_failure(r) or (code not in (None, *_TEARDOWN)):
            return None
    raised = {r: x.time for r in waiting if (x := view.exception(r)) is not None}
    issued = [e.time for r in waiting if (e := ctx.event(r)) is not None and e.time is not None]
    if not raised or not issued or any(view.first_failure(r) for r in roots):
        return None
    first, began = min(raised.values()), min(issued)
    wait = first - began
    if wait <= 0:
        return None
    for b in reversed(view.busy_records()):
        if b.kind != "busy":
            continue
        if any(b.states.get(str(r)) != "working" for r in roots):
            continue
        if any(b.states.get(str(r)) != "waiting" for r in waiting):
            continue
        covered = min(b.start + b.seconds, first) - max(b.start, began)
        if covered < COVERED * wait:
            continue
        v = div.per_rank[waiting[0]]
        return [
            f"{names(waiting)} waited in {v.op} #{div.seq} of group {div.group.label()}"
            f"{f' ({v.short_site})' if v.short_site else ''} for {names(roots)}, which never issued it, "
            f"until {'its' if len(waiting) == 1 else 'their'} own collective timeout raised ({wait:.0f} s)",
            f"moedoctor run saw {names(roots)} working outside any collective for {covered:.0f} s of that "
            f"wait ({b.line.removeprefix('busy: ')})",
            f"{names(roots)} raised nothing and ended with the job (stopped by the launcher after the "
            "timeout): still working, not crashed; it did not come back in the time the job allows",
        ]
    return None


def _where(view, rank: int) -> str:
    frame = view.stack_frame(rank)
    return f"rank {rank}'s main thread is in {frame}, outside torch.distributed"


def _suggest(view, rank: int) -> Suggestion:
    frame = view.stack_frame(rank)
    if frame is None:
        return Suggestion(None, None, _ADVICE)
    return Suggestion(
        f"{frame.file}:{frame.line}",
        frame.function,
        f"Rank {rank} is stuck in {frame.function}, not in a collective. " + _ADVICE,
    )


_ADVICE = (
    "Find out why it does not return (a hung read, a data loader worker, a lock, an endless loop): "
    "changing the collectives would be wrong. Bound the wait (a timeout and a retry on the read) and "
    "log which input it was on."
)


def from_stacks(ctx: StackContext) -> StackFinding | None:
    """Some ranks inside a collective, others outside any: the ones outside are where the others
    wait for them."""
    if not ctx.inside or not ctx.outside:
        return None
    culprits = sorted(r for c in ctx.outside for r in c.ranks)
    waiting = sorted(r for c in ctx.inside for r in c.ranks)
    odd = ctx.outside[0].stack
    be = "is" if len(culprits) == 1 else "are"
    summary = (
        f"{PATTERN.title}: {names(culprits)} {be} in {odd.where()}, outside any collective, while "
        f"{names(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in {ctx.ops(ctx.inside)}."
    )
    f = odd.user_frame
    suggestion = Suggestion(
        None if f is None else f"{f.file}:{f.line}",
        None if f is None else f.function,
        f"{names(culprits)} {be} stuck in {odd.where()}, not in a collective. " + PATTERN.advice,
    )
    return StackFinding(
        summary, culprits, f"{names(culprits)}: outside any collective while the others wait in one", suggestion
    )


# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


def waited_rank_working(ctx, mech) -> bool:
    """The stacks show a rank the others wait for running outside ``torch.distributed``; or, when the
    waiting ranks' own collective timeout ended the job, ``moedoctor run``'s busy record showed the
    awaited ranks working outside any collective for the whole wait, and they did not crash
    (``straggler.outlasted_wait``)."""
    if mech is not None and mech.state == RankState.WORKING:
        return True
    return outlasted_wait(ctx) is not None


WAITED_RANK_WORKING = Requirement(
    "a stack (or a busy record lasting until the others' timeout) showing the waited-for rank working "
    "outside torch.distributed",
    waited_rank_working,
)


DECLARATION = Declaration(
    "straggler",
    frozenset({M.RANK_OUTSIDE}),
    (WAITED_RANK_WORKING,),
    {"stack_frame", "in_distributed", "frozen", "died"} | EXCEPTION | EXITS | BUSY,
)

PATTERN = Pattern(
    id="straggler",
    title="Straggler (not a desync)",
    fixes=(),
    desync=False,
    classify=classify,
    advice=_ADVICE,
    from_stacks=from_stacks,
)
