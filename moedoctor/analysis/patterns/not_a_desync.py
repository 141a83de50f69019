"""``not-a-desync``: every rank is inside the same collective and none completes it.

Mechanism: not a code bug. The ranks agree on the collective (same op, shapes, dtypes, sequence
number) but it never completes: a dead link, a wedged GPU or NIC, a transport misconfiguration.
(A rank whose process does not run at all, stopped or in ``D``, is ``rank-stopped``.)

Evidence: named only when both of these are established, since a wrong confident "check the
hardware" is worse than "unknown":

- completion is observed: on every member, the recorder sees this group's collectives complete
  (an earlier one was seen completing), so the last one really did not. Where completions are not
  observed (NCCL works the recorder could not watch, functional collectives, Flight Recorder dumps
  without states) a collective "not completed" may be done, and another one the real block;
- every member's stack is inside the same collective, from the same call site (py-spy at the hang).
  A rank without a stack may be stuck elsewhere after issuing the collective asynchronously.

Then the NVML snapshot (ECC errors, retired or remapped pages, utilization), and the ranks that did
not answer the watchdog's snapshot request, point at the machine. When either condition cannot be
established the score drops below the threshold (0.3 with one missing, 0.2 with both, 0.1 when a
stack contradicts it: a rank outside any collective, or in another one), the report names no
pattern, and the evidence says what could not be established and what lowered the score.

Risk: a collective that is merely slow (a huge all-reduce on a slow network) looks the same until
the hang timeout; the NVML and responsiveness evidence is what points at the machine.

Fix: none in the code. Check the hardware and the network.
"""

from __future__ import annotations

from moedoctor.analysis.evidence.stack_reading import RankStack, read_rank_stack
from moedoctor.analysis.loading.run_data import SourceKind
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import Divergence, DivergenceKind, Suggestion
from moedoctor.analysis.patterns.base import Context, Declaration, Finding, Pattern, names, verb


#: Both conditions established.
ESTABLISHED = 0.9
#: One of them could not be established / neither could / a stack contradicts it.
ONE_UNKNOWN, BOTH_UNKNOWN, CONTRADICTED = 0.3, 0.2, 0.1


def classify(ctx: Context) -> Finding | None:
    div = ctx.div
    if div is None or div.kind != DivergenceKind.STALLED or ctx.cycle:
        return None
    view = ctx.view
    members = sorted(div.per_rank)
    v = div.per_rank[members[0]]
    evidence = [
        f"every rank of group {div.group.label()} ({names(members)}) issued the same {v.op} "
        f"#{div.seq} ({[list(s) for s in v.shapes]} {'/'.join(v.dtypes)}, {v.short_site}) last, and none "
        "was seen completing it"
    ]
    unknown: list[str] = []  # what could not be established
    against: list[str] = []  # what contradicts it

    unobserved = [r for r in members if not view.completion_observed(r, div.group.name, div.seq)]
    if unobserved:
        unknown.append(_completion_unknown(ctx, div, unobserved))
        evidence.extend(_order_hints(ctx, div))
    else:
        evidence.append(
            f"completion is observed on every member (earlier collectives of theirs were seen "
            f"completing, or Flight Recorder shows #{div.seq} pending): #{div.seq} really did not complete"
        )

    stack_unknown, stack_against, stack_fine = _stacks(ctx, members)
    unknown.extend(stack_unknown)
    against.extend(stack_against)
    evidence.extend(stack_fine)

    stopped = [r for r in members if view.frozen(r) in ("T", "t")]
    if stopped:
        against.append(
            f"{names(stopped)} {verb(stopped, 'does', 'do')} not run (stopped): a stopped process, "
            "not the hardware or network (rank-stopped)"
        )

    evidence.extend(hardware_evidence(ctx))
    missing = int(bool(unobserved)) + int(bool(stack_unknown))  # conditions not established
    if against:
        score = CONTRADICTED
    elif missing:
        score = ONE_UNKNOWN if missing == 1 else BOTH_UNKNOWN
    else:
        score = ESTABLISHED
    if score < ESTABLISHED:
        evidence.extend(f"not established: {line}" for line in unknown)
        evidence.extend(f"against it: {line}" for line in against)
        evidence.append(
            f"score {score:.2f} instead of {ESTABLISHED:.2f}: not named a hardware or network fault, "
            f"because {_why(bool(unobserved), bool(stack_unknown), stack_against, stopped)}"
        )
    return Finding(score, tuple(evidence), suggestion=Suggestion(None, None, _ADVICE))


def not_established(finding: Finding | None) -> str | None:
    """Why a stalled group was not named ``not-a-desync`` (from its finding), for the summary."""
    if finding is None:
        return None
    line = next((e for e in finding.evidence if e.startswith("score ") and "because " in e), None)
    return None if line is None else line.split("because ", 1)[1]


def _why(completion_unknown: bool, stacks_unknown: bool, stacks_against: list[str], stopped: list[int]) -> str:
    parts = []
    if stopped:
        parts.append(f"{names(stopped)} {verb(stopped, 'is', 'are')} stopped")
    if stacks_against:
        parts.append("a rank's stack shows it elsewhere")
    if completion_unknown:
        parts.append("completion of the collectives was not observed")
    if stacks_unknown:
        parts.append("not every rank's stack shows it inside this collective")
    return " and ".join(parts)


def _completion_unknown(ctx: Context, div: Divergence, ranks: list[int]) -> str:
    view = ctx.view
    e = view.event(ranks[0], div.group.name, div.seq)
    if view.run.kind == SourceKind.FLIGHT_RECORDER:
        why = "a Flight Recorder dump without completion states"
    elif e is not None and e.raw_op.startswith("_c10d_functional"):
        why = "a functional collective: the recorder does not see it complete"
    elif not any(view.completion_tracked(r) for r in ranks):
        why = (
            "no collective of theirs was ever seen completing: NCCL works the recorder could not watch, or "
            "a trace without completion records"
        )
    else:
        why = "no earlier collective of this group was seen completing there"
    return (
        f"completion of collectives was not observed on {names(ranks)} ({why}): that #{div.seq} never "
        "completed, and which collective each rank is really blocked in, is not known"
    )


def _order_hints(ctx: Context, div: Divergence) -> list[str]:
    """Other groups whose last collective the same ranks issued in a different order relative to
    this group's: with completion unknown, a collective order inversion cannot be ruled out."""
    view = ctx.view
    members = sorted(div.per_rank)
    found = []
    for name in sorted(view.groups):
        if name == div.group.name or not set(view.groups[name].ranks) & set(members):
            continue
        orders = {}
        for r in members:
            mine, theirs = view.event(r, div.group.name, div.seq), view.event(r, name, view.last_seq(r, name))
            if mine is None or theirs is None or theirs.completed is not None:
                continue
            orders[r] = mine.event_id < theirs.event_id
        if len(set(orders.values())) > 1:
            first = sorted(r for r, o in orders.items() if o)
            second = sorted(r for r, o in orders.items() if not o)
            other = view.groups[name].label()
            found.append(
                f"{names(first)} issued #{div.seq} of group {div.group.label()} before the last collective "
                f"of group {other}, {names(second)} after it: with completion unknown, a collective order "
                "inversion across these groups cannot be ruled out"
            )
    return found


def _stacks(ctx: Context, members: list[int]) -> tuple[list[str], list[str], list[str]]:
    """(could not be established, contradicts it, supports it) from the members' stacks."""
    view = ctx.view
    if not view.run.stacks:
        return (
            [
                "no stack was taken of any rank: that every rank waits inside this collective, and not "
                "elsewhere after issuing it, is not established"
            ],
            [],
            [],
        )
    absent, unreadable, outside = [], [], []
    inside: dict[int, RankStack] = {}
    for r in members:
        dump = view.stack(r)
        if dump is None:
            absent.append(r)
            continue
        rs = read_rank_stack(dump)
        if rs is None:
            unreadable.append(f"rank {r}'s stack could not be read ({(dump.error or 'no main thread').split('. ')[0]})")
        elif rs.collective is None:
            outside.append(f"rank {r}'s main thread is in {rs.where()}, not inside a collective")
        else:
            inside[r] = rs
    unknown = ([f"no stack for {names(absent)}"] if absent else []) + unreadable
    against = list(outside)
    places = {(rs.collective, _site(rs)) for rs in inside.values()}
    if len(places) > 1:
        against.append(
            "the ranks' stacks are in different places: "
            + "; ".join(f"rank {r} in {rs.waits_in} from {rs.where()}" for r, rs in sorted(inside.items()))
        )
    fine = []
    if inside and len(places) == 1:
        rs = next(iter(inside.values()))
        who = "every rank's" if len(inside) == len(members) else f"{names(inside)}'s"
        fine.append(f"{who} stack is inside {rs.waits_in}, called from {rs.where()}")
    return unknown, against, fine


def _site(rs: RankStack) -> str | None:
    f = rs.user_frame
    return None if f is None else f"{f.file}:{f.line}"


def hardware_evidence(ctx: Context) -> list[str]:
    view = ctx.view
    found = []
    for snap in view.run.gpus:
        if not snap.available:
            found.append(f"no GPU state for host {snap.host}: {snap.reason}")
            continue
        bad = []
        for d in snap.devices:
            if d.ecc_uncorrected:
                bad.append(f"GPU {d.index}: {d.ecc_uncorrected} uncorrected ECC errors")
            if d.retired_pending:
                bad.append(f"GPU {d.index}: page retirement pending")
            if d.remapped_failure:
                bad.append(f"GPU {d.index}: row remapping failed")
            if d.utilization is not None and d.utilization >= 99:
                bad.append(f"GPU {d.index}: {d.utilization}% busy (a kernel spinning, e.g. NCCL waiting)")
        found.append(
            f"NVML on {snap.host}: " + ("; ".join(bad) if bad else f"no GPU errors on {len(snap.devices)} GPU(s)")
        )
    if view.hang_declared:
        silent = [r for r in view.ranks if not any(c.reason == "snapshot" for c in view.traces[r].coverage)]
        if silent:
            found.append(
                f"{names(silent)} did not answer the watchdog's snapshot request (no coverage record): "
                "the process's Python threads are not running (stopped, or stuck in a driver call)"
            )
    return found


_ADVICE = (
    "Not a code problem: check the hardware and the network. Look for Xid errors in dmesg, ECC and retired "
    "pages in nvidia-smi -q, transport errors with NCCL_DEBUG=INFO, and each rank's process state "
    "(ps -o stat: T is stopped, D is stuck in the kernel). Patching the training code would be wrong."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------

DECLARATION = Declaration("not-a-desync", frozenset({M.TRANSPORT_HANG}), (), {"stack", "frozen"})

PATTERN = Pattern(
    id="not-a-desync",
    title="Not a desync (hardware or network)",
    fixes=(),
    desync=False,
    classify=classify,
    advice=_ADVICE,
)
