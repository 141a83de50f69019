"""``rank-stopped``: a rank's process does not run at all, so the others wait for it.

Mechanism: not a desync. A rank's process is stopped (state ``T``: a SIGSTOP, a job-control stop,
a scheduler suspending it, a debugger; ``t``: a tracer holds it) or stuck in uninterruptible sleep
(``D``: a kernel or driver call that does not return: a hung NFS or Lustre read, a GPU driver
call). None of its threads run, so it neither issues nor completes collectives, and whatever the
other ranks wait in never completes. Whether it stopped inside the collective (the others see the
group stalled) or before it (the others see it missing) says nothing about the code.

Evidence: the process state moedoctor read from ``/proc/PID/stat`` when the hang was diagnosed,
several readings before and after the stack dump, all ``T``/``t`` or all ``D`` (a process passes
through ``D`` briefly on every disk read: one reading is not enough), and ``wchan``; that rank's
last collective and whether it completed; the ranks waiting for it (the group's missing members or
the wait-for graph's roots, or the members of a stalled group). A stopped rank that the others do
not wait for scores lower.

Risk: a rank that was stopped deliberately and would be continued (a debugger session) looks the
same; the report says so. It is not named over a proven code desync: two ranks that issued
different collectives at one sequence number (a mismatch, a wait-for cycle) disagree whatever
either does next, so there the stopped rank is reported as a fact beside the desync.

Fix: none in the code. Find who stopped the process (a SIGSTOP, ``kill -STOP``, Ctrl-Z, a batch
scheduler's suspend, a debugger) and continue it (``kill -CONT PID``) or detach; for ``D``, the
kernel log (``dmesg``: hung task, Xid, NFS "server not responding") and the device or mount named by
``wchan``.
"""

from __future__ import annotations

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.mechanisms.waitfor import chain_roots
from moedoctor.analysis.model import DivergenceKind, Suggestion
from moedoctor.analysis.patterns.base import Context, Declaration, Finding, Pattern, StackContext, StackFinding, names
from moedoctor.process_state import ProcessState


#: The stopped rank is the one the others wait for (or inside the stalled collective).
AWAITED = 0.95
#: A rank does not run, but the others are not seen waiting for it.
ELSEWHERE = 0.6
#: Ranks described one by one, at most (a whole suspended job is named in one line beyond).
MAX_LINES = 8


def classify(ctx: Context) -> Finding | None:
    view = ctx.view
    frozen = view.frozen_ranks
    if not frozen or not ctx.hang or ctx.cycle:
        return None
    div = ctx.div
    if div is not None and not (
        div.kind in (DivergenceKind.MISSING, DivergenceKind.STALLED) or (div.kind == DivergenceKind.P2P and div.missing)
    ):
        return None  # the ranks issued different collectives: a desync, whatever stopped since
    awaited = _awaited(ctx)
    related = sorted(r for r in frozen if awaited is None or r in awaited)
    stopped = related or sorted(frozen)
    listed = stopped + [r for r in sorted(frozen) if r not in stopped]
    evidence = [stopped_line(view, r, frozen[r]) for r in listed[:MAX_LINES]]
    if len(listed) > MAX_LINES:
        evidence.append(f"{names(listed[MAX_LINES:])} do not run either")
    waiting = _waiting_line(ctx, stopped)
    if waiting:
        evidence.append(waiting)
    if not related:
        evidence.append(
            f"the other ranks are not seen waiting for {names(stopped)} "
            "(score lowered: another rank may hold the job as well)"
        )
    evidence.append("a process that does not run is not a code desync: no change to the collectives applies")
    return Finding(
        AWAITED if related else ELSEWHERE,
        tuple(evidence),
        culprits=tuple(stopped),
        suggestion=Suggestion(None, None, advice(frozen[stopped[0]], stopped[0], view.stack(stopped[0]))),
    )


def _awaited(ctx: Context) -> set[int] | None:
    """The ranks the others wait for (None: no divergence, every rank counts)."""
    div = ctx.div
    if div is None:
        return None
    if div.kind == DivergenceKind.STALLED:
        return set(div.per_rank)
    found = set(div.missing) | set(ctx.culprits.ranks)
    if div.missing:
        found |= set(chain_roots(ctx.edges, div.missing))
    return found


def stopped_line(view, rank: int, state: ProcessState) -> str:
    """``rank 1 is stopped (state T: ...) — its last collective was all_reduce #3 of group 0 ...``."""
    last = view.last_event.get(rank)
    if last is None:
        where = "it issued no collective"
    else:
        site = f", {last.call_site.short}" if last.call_site else ""
        done = "completed" if last.completed is not None else "not seen completing"
        where = (
            f"its last collective was {last.op} #{last.seq} of group {view.groups[last.group.name].label()}"
            f"{site}, {done}"
        )
    frame = view.stack_frame(rank)
    if frame is not None:
        inside = view.in_distributed(rank)
        where += f"; its main thread is in {frame}" + (", inside torch.distributed" if inside else "")
    return f"rank {rank}'s process is {state.describe()} — {where}"


def waits_in(view, div, rank: int) -> tuple[str, int, str | None, bool]:
    """``(op, seq, short call site, moved)``: the collective of the divergence's group that ``rank``
    waits in. The divergence's own collective, unless the rank's trace shows it completed: then the
    awaited ranks took part in it though their traces end before it (a stopped rank's last records
    may not be written yet: the native recorder writes every 2 ms), and the rank waits in the first
    collective of the group after it that it did not complete (``moved``)."""
    v = div.per_rank[rank]
    group = div.group.name
    e = view.event(rank, group, div.seq)
    if e is not None and e.completed is not None:
        later = [x for s, x in sorted(view.seq_map(rank, group).items()) if s > div.seq and x.completed is None]
        if later:
            x = later[0]
            return x.op, x.seq, x.call_site.short if x.call_site else None, True
    return v.op, div.seq, v.short_site, False


def _waiting_line(ctx: Context, stopped: list[int]) -> str | None:
    div = ctx.div
    if div is None:
        return None
    waiting = sorted(r for r, v in div.per_rank.items() if v is not None and r not in stopped)
    if not waiting:
        return None
    op, seq, short_site, moved = waits_in(ctx.view, div, waiting[0])
    site = f" ({short_site})" if short_site else ""
    verb = "waits" if len(waiting) == 1 else "wait"
    line = (
        f"{names(waiting)} {verb} in {op} #{seq} of group {div.group.label()}{site} for "
        f"{'it' if len(stopped) == 1 else 'them'}"
    )
    if moved:
        v = div.per_rank[waiting[0]]
        line += (
            f"; {names(waiting)} completed {v.op} #{div.seq}, so {names(stopped)} issued it too, though "
            f"{'its trace ends' if len(stopped) == 1 else 'their traces end'} before it (the last records "
            "were not written when the process stopped)"
        )
    return line


def advice(state: ProcessState | None, rank: int | None = None, dump=None) -> str:
    """What to do about a rank that does not run: never a change to the code."""
    pid = f" {dump.pid}" if dump is not None else " PID"
    who = f"rank {rank}" if rank is not None else "the rank"
    if state is not None and state.frozen == "D":
        where = f" (it sleeps in {state.wchan})" if state.wchan else ""
        return (
            f"Not a code problem: {who}'s process is stuck in a kernel or driver call{where}. Read the kernel "
            'log (dmesg: hung task warnings, GPU Xid errors, NFS/Lustre "server not responding"), check the '
            "device or the mount it waits on, and the node's health. Changing the collectives would be wrong."
        )
    return (
        f"Not a code problem: {who}'s process is stopped. Find what stopped it (kill -STOP, Ctrl-Z, a batch "
        f"scheduler suspending the job, a debugger attached to it) and continue it (kill -CONT{pid}) or "
        "detach the debugger. Changing the collectives would be wrong."
    )


def from_stacks(ctx: StackContext) -> StackFinding | None:
    """A rank whose process does not run, wherever its stack is (in every reading of ``/proc``
    around its dump): the others wait for it."""
    if not ctx.frozen:
        return None
    culprits = sorted(ctx.frozen)
    others = [c for c in ctx.inside if not set(c.ranks) <= set(ctx.frozen)]
    waiting = sorted(r for c in others for r in c.ranks if r not in ctx.frozen)
    by_why: dict[str, list[int]] = {}
    for r, why in ctx.frozen.items():
        by_why.setdefault(why, []).append(r)
    summary = (
        f"{PATTERN.title}: "
        + "; ".join(
            f"{names(rs)}'s process{'' if len(rs) == 1 else 'es'} {'is' if len(rs) == 1 else 'are'} {why}"
            for why, rs in by_why.items()
        )
        + (
            f", while {names(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in {ctx.ops(others)}"
            if waiting
            else ""
        )
        + ". Not a code desync: no change to the collectives applies."
    )
    first = culprits[0]
    dump = ctx.stacks.get(first)
    state = dump.process if dump is not None and dump.process is not None else ProcessState(ctx.letters[first])
    return StackFinding(
        summary,
        culprits,
        f"{names(culprits)}: the process does not run",
        Suggestion(None, None, advice(state, first, dump)),
    )


# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


def process_not_running(ctx, mech) -> bool:
    """A rank's process state (read from /proc at the hang) says it does not run."""
    return bool(ctx.view.frozen_ranks)


PROCESS_NOT_RUNNING = Requirement("a process state showing a rank that does not run", process_not_running)


DECLARATION = Declaration(
    "rank-stopped",
    frozenset({M.RANK_OUTSIDE, M.TRANSPORT_HANG}),
    (PROCESS_NOT_RUNNING,),
    {"frozen_ranks", "stack", "stack_frame", "in_distributed"},
)

PATTERN = Pattern(
    id="rank-stopped",
    title="A rank does not run (stopped, or stuck in the kernel)",
    fixes=(),
    desync=False,
    classify=classify,
    advice=advice(None),
    from_stacks=from_stacks,
)
