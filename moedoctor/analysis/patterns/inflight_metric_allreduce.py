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
A per-micro-batch all-reduce of a rank that ran more micro-batches than the others, which sync
their gradients in their last backward pass (DDP ``no_sync``), looks alike too: the others'
collective is in a backward pass the small all-reduce's rank ran to its end without any collective
(``deferred_sync``); in the first step no earlier step tells the two apart, and the finding is 0.1.

Fix ``metrics-after-microbatches``: accumulate metrics locally and all-reduce them once after the
last micro-batch (or on a separate process group). It patches named functions only. When the other
ranks' collective is the forward all-gather of an FSDP unit the metric ranks had not gathered yet in
that step (a kept-unsharded unit gathered at its first use), the finding points
``fsdp-gather-upfront`` at the job by structure (``fix_config``): the kept units are gathered when
the root's forward starts, so the metric all-reduce meets the metric all-reduce.

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 6 variants of `inflight-metric-allreduce/`
(hand-written bucket reducer, FSDP2 vision tower, HSDP, MoE load meter, functional collectives,
checkpointed demix): 6/6 after the change; the printed verify (`fsdp-gather-upfront`) passes on the 5
FSDP2 ones, the hand-written bucket reducer has no automatic fix. Confusions seen before it: at step 0 (no history) left
`unknown-desync` (2); against a 34-element bucket all-reduce (`SMALL`) named
`microbatch-count-mismatch`; a rank-conditional callback and hook named this pattern (a step loop
mistaken for a micro-batch loop); a skipped step's gradient check named this pattern.
"""

from __future__ import annotations

from collections import Counter

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.evidence.source import calls_in, fixed_trip_count, rank_guard, shared_loop
from moedoctor.analysis.evidence.steps import deferred_sync
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import (
    DESYNC,
    SAME_POSITION,
    SOURCE,
    Context,
    Declaration,
    Finding,
    Pattern,
    ev,
    names,
    verb,
)
from moedoctor.events import Phase


#: A metric all-reduce moves a handful of scalars.
SMALL = 64
#: Where a training loop issues metric all-reduces (not inside Optimizer.step or a checkpoint save).
#: Not ``backward``: a collective issued while autograd runs comes from a gradient hook, the in-flight side.
_USER_PHASES = {"other", "forward"}
#: The small collectives a training loop issues for its own statistics: a metric's all_reduce, or a
#: per-rank value's all_gather (LLaVA's modality counts of corpus 27).
_METRIC_OPS = ("all_reduce", "all_gather")


def _skipped_before_backward(view, group: str, rank: int, metric, theirs) -> bool:
    """``rank`` is in the backward pass of the metric's step and has not issued the metric's call site
    in that step, while every earlier step of it that issued that call site issued it exactly once,
    before the step's first backward collective (a metric issued every few steps, or once after a
    loop of optimizer steps, leaves the steps between without it): the rank passed the place of the
    metric without issuing it (left it out, or is still in a loop the others left), where an
    in-flight metric would come after or among the step's reductions."""
    if theirs is None or theirs.phase != "backward" or theirs.step != metric.step:
        return False
    by_step: dict[int, list] = {}
    for e in view.events(rank, group, before=theirs.seq + 1):
        by_step.setdefault(e.step, []).append(e)
    if any(e.call_site is not None and e.call_site.where == metric.call_site for e in by_step.get(metric.step, [])):
        return False
    issued = 0
    for s in (s for s in by_step if s < metric.step):
        events = by_step[s]
        at = [i for i, e in enumerate(events) if e.call_site is not None and e.call_site.where == metric.call_site]
        if not at:
            continue
        back = [i for i, e in enumerate(events) if e.phase == "backward"]
        if len(at) != 1 or not back or back[0] < at[0]:
            return False
        issued += 1
    return issued > 0


def classify(ctx: Context) -> Finding | None:
    if ctx.div is None or ctx.div.kind.value != "mismatch":
        return None  # the metric all-reduce is matched against another collective, not against nothing
    div, view = ctx.div, ctx.view
    present = ctx.present()
    small = sorted(
        r
        for r, v in present.items()
        if v.op in _METRIC_OPS and v.numel <= SMALL and v.module is None and v.phase in _USER_PHASES
    )
    other = sorted(r for r in div.per_rank if r not in small)
    if not small or not other:
        return None
    v = present[small[0]]
    group = div.group.name
    stack = ctx.stack(small[0])
    if rank_guard(stack) is not None:
        return None  # issued under a branch on the rank: rank-conditional, not a misplaced metric
    restarted = [r for r in other if view.discarded_in(r, v.step)]
    if restarted:
        return None  # the others threw their step away and began the next one: a skipped step, not a metric
    theirs = [present[r] for r in other if r in present]
    if theirs and min(present[r].step for r in small) > max(t.step for t in theirs):
        return None  # the small collective opens a later step: its ranks closed the step the others are in
    if any(_skipped_before_backward(view, group, r, v, ctx.event(r)) for r in other):
        return None  # the metric comes once a step, before backward: a rank in backward without it left it out
    history = all(view.issued_from(r, group, v.call_site) for r in other)
    loop = shared_loop(stack)
    if loop is not None and calls_in(loop.file, loop.line, "step"):
        loop = None  # the training-step loop, not a micro-batch loop: says nothing about micro-batches
    if not history and loop is None:
        return None  # a call site the other ranks never used, and nothing shows it runs on every rank
    if theirs and all(
        t.op in _METRIC_OPS and t.numel <= SMALL and t.module is None and t.phase not in ("forward", "backward")
        for t in theirs
    ):
        return None  # two metric all-reduces: a different pattern (shape mismatch / rank-conditional)
    desc = ", ".join(
        f"rank {r}: "
        + (
            "nothing"
            if div.per_rank[r] is None
            else f"{div.per_rank[r].op} {[list(s) for s in div.per_rank[r].shapes]}"
            + (f" of FSDP unit {div.per_rank[r].module}" if div.per_rank[r].module else "")
        )
        for r in other[:4]
    )
    if not any(t.module is not None or t.phase in ("forward", "backward") for t in theirs):
        return None  # nothing FSDP-issued or from forward/backward to be matched against: nothing in flight
    # A micro-batch loop of a fixed number of passes (``range`` of a literal) runs as many on every
    # rank: the ranks cannot disagree on which pass is the last, so a pass without the others'
    # reductions had them held back (buckets waiting for a gradient), the in-flight reading.
    fixed = loop is not None and fixed_trip_count(loop) is not None
    for r in other:
        e = ctx.event(r)
        n = None if e is None or fixed else deferred_sync(view, e, small)
        if n is not None:
            return Finding(
                0.1,
                (
                    f"rank {r}'s {e.op} is issued by its backward pass {n} of step {e.step}, which "
                    f"{names(small)} ran to its end without any collective on group {div.group.label()}: "
                    "the ranks disagree on which backward pass synchronises gradients (the last "
                    "micro-batch), not on where a metric all_reduce lands",
                ),
            )
        first = e is not None and not any(
            b.step < e.step for q in (r, *small) for b in view.evidence(q, "backward_begin")
        )
        n = deferred_sync(view, e, small, habit=False) if first and e is not None and not fixed else None
        if n is not None:
            # The first step: no earlier step can show the habit (or its absence), but the metric
            # ranks ran this backward pass to its end without the collective the others issue in
            # it: either reading fits, name neither.
            return Finding(
                0.1,
                (
                    f"rank {r}'s {e.op} is issued by its backward pass {n} of step {e.step}, which "
                    f"{names(small)} ran to its end without any collective on group {div.group.label()}: "
                    "the ranks may disagree on which backward pass synchronises gradients (a micro-batch "
                    "count mismatch) rather than on where a metric all_reduce lands",
                ),
            )
    score = 0.3 if history else 0.2
    evidence = [
        f"at #{div.seq} of group {div.group.label()} {names(small)} issued a {v.numel}-element all_reduce "
        f"from user code ({v.short_site}) where the others issued {desc}"
    ]
    if loop is not None:
        score += 0.1
        evidence.append(
            f"it is issued inside the loop at {loop.short} ({loop.text}), which runs the backward passes "
            "and no optimizer step (a micro-batch loop), under no branch on the rank: every rank issues "
            "it, once per micro-batch"
        )
    elif history:
        evidence.append(f"{names(other)} issued collectives from {v.short_site} before: every rank issues it")
    fsdp = [t for t in theirs if t.module is not None]
    if fsdp:
        score += 0.3
    elif any(t.phase == "backward" for t in theirs):
        score += 0.2  # issued from autograd (a gradient hook): in flight while the loop goes on
    elif any(t.numel > SMALL for t in theirs):
        score += 0.15
    # Issued once per micro-batch: the same call site several times in one step.
    per_step = Counter(
        e.step for e in view.events(small[0], group) if e.call_site is not None and e.call_site.where == v.call_site
    )
    if per_step and max(per_step.values()) >= 2:
        score += 0.2
        step, n = max(per_step.items(), key=lambda kv: (kv[1], -kv[0]))
        evidence.append(
            f"{v.short_site} issues {n} all_reduces per step on rank {small[0]} (step {step}): "
            "it runs inside the micro-batch loop"
        )
    fix_config = None
    for t in fsdp[:1]:
        gathered = any(
            e.module == t.module and e.op == t.op and e.step == t.step
            for e in view.events(small[0], group, before=div.seq)
        )
        if not gathered:
            score += 0.1
            if t.op == "all_gather" and t.phase == "forward":
                # A unit gathered by the first forward that uses it: gathering the kept units when the
                # root's forward starts puts these all-gathers in one place on every rank.
                fix_config = {"fsdp-gather-upfront": {"units": "kept"}}
            evidence.append(
                f"{names(small)} had not yet issued the {t.op} of FSDP unit {t.module} in step {t.step} "
                f"that {names(other)} {verb(other, 'was', 'were')} in: the FSDP collectives before the "
                "metric all_reduce differ across ranks"
            )
    caller = ""
    if len(stack) > 1:
        caller = f" (called from {stack[1].rsplit('/', 1)[-1]})"
    suggestion = Suggestion(v.call_site, v.function, _ADVICE + caller)
    return Finding(
        round(score, 3), tuple(evidence), suggestion=suggestion, culprits=tuple(small), fix_config=fix_config
    )


_ADVICE = (
    "Move the metric all_reduce out of the micro-batch loop: accumulate the metrics locally and "
    "all_reduce them once after the last micro-batch, or reduce them on a separate process group."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


def sharded_or_bucketed_other_side(ctx, mech) -> bool:
    """At the divergence some rank issued a collective of a sharded unit (FSDP, ``mod`` set) or of
    backward (a gradient bucket): what a misplaced metric all-reduce meets."""
    return any(v.module is not None or v.phase == Phase.BACKWARD.value for v in ctx.present().values())


SHARDED_OR_BUCKETED_OTHER_SIDE = Requirement(
    "a sharded-unit (FSDP) or backward-bucket collective on the other side", sharded_or_bucketed_other_side
)


DECLARATION = Declaration(
    "inflight-metric-allreduce",
    DESYNC | SAME_POSITION,
    (SHARDED_OR_BUCKETED_OTHER_SIDE,),
    ev("backward_begin", "backward_end") | {"discarded_in"} | SOURCE,
)

PATTERN = Pattern(
    id="inflight-metric-allreduce",
    title="Metric all-reduce while FSDP collectives are in flight",
    fixes=("metrics-after-microbatches", "fsdp-gather-upfront"),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
