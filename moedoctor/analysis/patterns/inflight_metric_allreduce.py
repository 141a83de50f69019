"""``inflight-metric-allreduce``: a metric all-reduce lands at different places of the stream.

Mechanism: ``dist.all_reduce`` of a metric is issued inside the micro-batch loop while FSDP2's
collectives (all-gathers in forward, reduce-scatters from backward hooks) vary per rank (MoE
routing, hooks fired late): on some ranks the small all-reduce is matched against a large FSDP
collective of the others, at the same sequence number, and both wait forever.

Evidence: at the divergence, a small all-reduce (at most ``SMALL`` elements, no FSDP unit) issued
from user code on some ranks against an FSDP collective (``mod`` set) or another op on the others;
its call site issues several all-reduces per step (one per micro-batch); the FSDP unit the others
gather was not gathered yet this step on the metric ranks.

Risk: a small all-reduce that is legitimately rank-conditional looks alike: that pattern needs a
call site the other ranks never use, this one a call site every rank uses.

Fix ``metrics-after-microbatches``: accumulate metrics locally and all-reduce them once after the
last micro-batch (or on a separate process group).
"""

from __future__ import annotations

from collections import Counter

from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns import Context, Finding, Pattern, names, verb

#: A metric all-reduce moves a handful of scalars.
SMALL = 64
#: Where a training loop issues metric all-reduces (not inside Optimizer.step or a checkpoint save).
_USER_PHASES = {"other", "forward", "backward"}


def classify(ctx: Context) -> Finding | None:
    if ctx.div is None or ctx.div.kind.value != "mismatch":
        return None  # the metric all-reduce is matched against another collective, not against nothing
    div, view = ctx.div, ctx.view
    present = ctx.present()
    small = sorted(r for r, v in present.items() if v.op == "all_reduce" and v.numel <= SMALL and v.module is None
                   and v.phase in _USER_PHASES)
    other = sorted(r for r in div.per_rank if r not in small)
    if not small or not other:
        return None
    v = present[small[0]]
    group = div.group.name
    if not all(view.issued_from(r, group, v.call_site) for r in other):
        return None  # a call site the other ranks never use: rank-conditional, not a misplaced metric
    theirs = [present[r] for r in other if r in present]
    if theirs and all(t.op == "all_reduce" and t.numel <= SMALL and t.module is None for t in theirs):
        return None  # two metric all-reduces: a different pattern (shape mismatch / rank-conditional)
    desc = ", ".join(f"rank {r}: " + ("nothing" if div.per_rank[r] is None else
                                      f"{div.per_rank[r].op} {[list(s) for s in div.per_rank[r].shapes]}"
                                      + (f" of FSDP unit {div.per_rank[r].module}" if div.per_rank[r].module else ""))
                     for r in other[:4])
    if not any(t.module is not None or t.numel > SMALL for t in theirs):
        return None  # nothing large or FSDP-issued to be matched against: no sign of collectives in flight
    score = 0.3
    evidence = [f"at #{div.seq} of group {div.group.label()} {names(small)} issued a {v.numel}-element all_reduce "
                f"from user code ({v.short_site}) where the others issued {desc}"]
    fsdp = [t for t in theirs if t.module is not None]
    if fsdp:
        score += 0.3
    elif any(t.numel > SMALL for t in theirs):
        score += 0.15
    # Issued once per micro-batch: the same call site several times in one step.
    per_step = Counter(e.step for e in view.events(small[0], group) if e.call_site is not None
                       and f"{e.call_site.file}:{e.call_site.line}" == v.call_site)
    if per_step and max(per_step.values()) >= 2:
        score += 0.2
        step, n = max(per_step.items(), key=lambda kv: (kv[1], -kv[0]))
        evidence.append(f"{v.short_site} issues {n} all_reduces per step on rank {small[0]} (step {step}): "
                        "it runs inside the micro-batch loop")
    for t in fsdp[:1]:
        gathered = any(e.module == t.module and e.op == t.op and e.step == t.step
                       for e in view.events(small[0], group, before=div.seq))
        if not gathered:
            score += 0.1
            evidence.append(f"{names(small)} had not yet issued the {t.op} of FSDP unit {t.module} in step {t.step} "
                            f"that {names(other)} {verb(other, 'was', 'were')} in: the FSDP collectives before the "
                            "metric all_reduce differ across ranks")
    event = ctx.event(small[0])
    caller = ""
    if event is not None and event.call_site is not None and len(event.call_site.stack) > 1:
        caller = f" (called from {event.call_site.stack[1].rsplit('/', 1)[-1]})"
    suggestion = Suggestion(v.call_site, v.function, _ADVICE + caller)
    return Finding(round(score, 3), tuple(evidence), suggestion=suggestion)


_ADVICE = ("Move the metric all_reduce out of the micro-batch loop: accumulate the metrics locally and "
           "all_reduce them once after the last micro-batch, or reduce them on a separate process group.")

PATTERN = Pattern(
    id="inflight-metric-allreduce", title="Metric all-reduce while FSDP collectives are in flight",
    fixes=("metrics-after-microbatches",), desync=True, classify=classify, advice=_ADVICE,
)
