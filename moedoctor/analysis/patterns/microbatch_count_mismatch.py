"""``microbatch-count-mismatch``: ranks run different numbers of micro-batches in one step.

Mechanism: dynamic batching (token budgets, variable sequence lengths) gives ranks different numbers
of micro-batches. The rank that runs out first moves on to the step's closing collectives
(gradient clipping, the optimizer, metrics) while the others still issue the per-micro-batch ones
(FSDP all-gathers in forward, reduce-scatters in backward).

Evidence: at the divergence, some ranks are in forward/backward while the others have moved on
(optimizer or other code) or never issued it; the in-loop ranks have logged at least as many
backward passes in this step as the ranks that moved on, and have not computed this step's
gradient norm yet; in earlier steps the ranks ran the same number of backward passes. Where the
per-micro-batch collectives follow each backward pass (no phase to split them), the ranks that
stepped are told by their step counter: their collective is of a later step while the others issue
again one of the earlier step's repeated part, after more backward passes in it than the stepping
ranks ran, or as many where their earlier steps ran more passes and they cleared no gradients since
their last one (``steps.usual_pass``; otherwise as many is the next iteration of a rank that skipped
its step, not another micro-batch). That split is tried first.

Risk: a rank in the *next* iteration's forward (after skipping its optimizer step) looks alike;
a gradient norm or optimizer step already logged for this step on the in-loop ranks rules it out.
A rank whose "closing" collective is issued outside forward and backward from inside the very
micro-batch loop the others go round again (``source.same_loop``) did not leave the loop: an extra
collective within an iteration (an in-flight metric, corpus 24's TRL DPO and OLMoE), 0.1.

Fix: agree on the number of micro-batches per step (all_reduce MAX of the local count, pad with
empty micro-batches), or balance the batches so every rank has the same count.

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 5 variants of `microbatch-count-mismatch/`
(DDP filtered split, FSDP2 epoch tail, token budget, functional packer, HSDP planner): 5/5 after the
change. Confusions seen before it: four left `unknown-desync` (FSDP2 syncs only the last
micro-batch: both sides are in backward/forward, which phases alone could not split); this pattern
claimed four skipped optimizer steps (the next iteration looks like another micro-batch until
`zero_grad` shows the step was thrown away).
"""

from __future__ import annotations

from collections import Counter

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.evidence.source import calls_in, same_loop, shared_loop
from moedoctor.analysis.evidence.steps import CLOSING, RESTART, another_pass, deferred_sync, usual_pass
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
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


def _split(ctx: Context) -> tuple[list[int], list[int], str] | None:
    """(in_loop, moved_on, how): the ranks still in the step's repeated part and those that left it."""
    div = ctx.div
    present = ctx.present()
    where = ctx.positions()
    restart = sorted(r for r, p in where.items() if p == RESTART)
    closing = sorted(r for r, p in where.items() if p == CLOSING)
    if restart and closing and len(restart) + len(closing) == len(present):
        return restart, closing + sorted(r for r in div.per_rank if r not in present), "structure"
    if restart and not closing:
        # The others stepped: their collective is of a later step (the optimizer's step hook moved
        # their counter on) while the restarting ranks are still in the step's repeated part.
        step = min(present[r].step for r in restart)
        later = sorted(r for r, v in present.items() if r not in restart and v.step > step)
        if later and len(restart) + len(later) == len(present):
            return restart, later + sorted(r for r in div.per_rank if r not in present), "step"
    in_loop = sorted(r for r, v in present.items() if v.phase in ("forward", "backward"))
    moved_on = sorted(r for r in div.per_rank if r not in in_loop)
    if in_loop and moved_on and not any(where.get(r) == RESTART for r in moved_on):
        return in_loop, moved_on, "phase"
    return None


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind() or ctx.div.kind.value == "p2p":
        return None
    div, view = ctx.div, ctx.view
    present = ctx.present()
    split = _split(ctx)
    if split is None:
        return None
    in_loop, moved_on, how = split
    stuck = [r for r in moved_on if r in present and present[r].phase not in ("forward", "backward")]
    loops = {r: same_loop(ctx.stack(r), ctx.stack(in_loop[0])) for r in stuck}
    if stuck and len(stuck) == len([r for r in moved_on if r in present]) and all(loops.values()):
        loop = loops[stuck[0]]
        assert loop is not None
        return Finding(
            0.1,
            (
                f"{names(stuck)} issued {verb(stuck, 'its', 'their')} collective inside the loop at {loop.short} "
                f"({loop.text}) that {names(in_loop)} went round again: {verb(stuck, 'it', 'they')} did not "
                "leave the micro-batch loop early, an extra collective was issued within an iteration",
            ),
        )
    step = present[in_loop[0]].step
    since = min(present[r].time for r in in_loop)
    backwards = {r: len(view.evidence(r, "backward_begin", step)) for r in div.per_rank}
    closed = [
        r
        for r in in_loop
        if any(e.time < since for kind in ("grad_norm", "optimizer_step_begin") for e in view.evidence(r, kind, step))
    ]
    if closed:
        return Finding(
            0.1,
            (
                f"{names(closed)} already computed the step {step} gradient norm: the forward is the "
                "next iteration's, not an extra micro-batch",
            ),
        )
    discarded = [r for r in in_loop if view.discarded_in(r, step)]
    if discarded:
        return Finding(
            0.1,
            (
                f"{names(discarded)} cleared {'its' if len(discarded) == 1 else 'their'} gradients "
                f"(zero_grad) after a step {step} backward pass without stepping: the next iteration, "
                "not another micro-batch",
            ),
        )
    done = max(backwards[r] for r in moved_on)
    if done == 0 or min(backwards[r] for r in in_loop) < done:
        return None
    if (
        how == "step"
        and min(backwards[r] for r in in_loop) <= done
        and not all((e := ctx.event(r)) is not None and usual_pass(view, e) for r in in_loop)
    ):
        # As many passes as the others before it began again, a pass its earlier steps never ran
        # (or after clearing the gradients): the next iteration of a rank that skipped its step.
        return None
    score = 0.55 if how in ("structure", "step") else 0.45
    if how == "step":
        evidence = [
            f"at #{div.seq} of group {div.group.label()} {names(in_loop)} issued again a collective of step "
            f"{step}'s repeated part after more backward passes than {names(moved_on)} ran in that step, while "
            f"{names(moved_on)} stepped and went on to step {min(present[r].step for r in moved_on if r in present)}; "
            "backward passes in step "
            f"{step}: " + ", ".join(f"rank {r}: {backwards[r]}" for r in sorted(div.per_rank))
        ]
    elif how == "structure":
        evidence = [
            f"at #{div.seq} of group {div.group.label()} {names(in_loop)} issued again a collective "
            f"{'it' if len(in_loop) == 1 else 'they'} had issued earlier in step {step} (another pass over "
            f"the step's repeated part) while {names(moved_on)} issued one not issued yet in the step "
            f"(closing it); backward passes so far: "
            + ", ".join(f"rank {r}: {backwards[r]}" for r in sorted(div.per_rank))
        ]
    else:
        evidence = [
            f"at step {step} {names(moved_on)} moved on after {done} backward pass(es) while {names(in_loop)} "
            f"{'is' if len(in_loop) == 1 else 'are'} in another micro-batch "
            f"({', '.join(f'rank {r}: {backwards[r]}' for r in in_loop)} backward passes so far)"
        ]
    synced = {r: n for r in moved_on if (e := ctx.event(r)) is not None and (n := deferred_sync(view, e, in_loop))}
    if synced and len(synced) == len([r for r in moved_on if r in present]):
        n = min(synced.values())
        score += 0.15
        evidence.append(
            f"{names(sorted(synced))} {verb(sorted(synced), 'issues', 'issue')} its collective in backward pass {n} "
            f"of step {step}, while {names(in_loop)} ran backward pass {n} to its end without any collective on "
            f"group {div.group.label()} (gradient synchronisation deferred): the ranks disagree on which "
            "micro-batch is the step's last"
        )
    earlier = {r: Counter(e.step for e in view.evidence(r, "backward_begin") if e.step < step) for r in div.per_rank}
    common = set.intersection(*(set(c) for c in earlier.values())) if earlier else set()
    if common and all(len({earlier[r][s] for r in earlier}) == 1 for s in common):
        score += 0.05
        evidence.append(f"in steps {min(common)}-{max(common)} every rank ran the same number of micro-batches")
    v = present[in_loop[0]]
    loop = shared_loop(ctx.stack(in_loop[0]))
    if loop is not None and not calls_in(loop.file, loop.line, "step"):
        score += 0.1
        whose = verb(in_loop, "'s", "'")
        evidence.append(
            f"{names(in_loop)}{whose} collective is issued inside the loop at "
            f"{loop.short} ({loop.text}), "
            "which runs the backward passes and no optimizer step: a micro-batch loop"
        )
    return Finding(
        round(score, 3),
        tuple(evidence),
        culprits=tuple(moved_on),
        suggestion=Suggestion(v.call_site, v.function, _ADVICE),
    )


_ADVICE = (
    "Make the number of micro-batches per step the same on every rank: all_reduce the local count with "
    "ReduceOp.MAX and pad with empty micro-batches, or balance the batches before the step."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


def gradient_accumulation(ctx, mech) -> bool:
    """Some rank ran more than one backward pass within one step (micro-batches), or began the
    step's repeated part again after a backward pass of the step (``steps.position``: restart) in a
    job whose earlier steps do not all show exactly one backward pass per step."""
    if ctx.div is None:
        return False
    passes = {r: [e.step for e in ctx.view.evidence(r, "backward_begin")] for r in ctx.div.per_rank}
    if any(steps.count(s) > 1 for steps in passes.values() for s in set(steps)):
        return True
    # No step of any rank had two backward passes. A restart of the step's repeated part where every
    # rank shows at least two earlier steps of one backward pass each: the step counter did not move,
    # which a skipped optimizer step shows as well (no accumulation seen).
    step = min((v.step for v in ctx.present().values()), default=0)
    one_per_step = all(len({s for s in steps if s < step}) >= 2 for steps in passes.values())
    return "restart" in ctx.positions().values() and not one_per_step


GRADIENT_ACCUMULATION = Requirement("more than one backward pass in a step (micro-batches)", gradient_accumulation)


def another_pass_begun(ctx, mech) -> bool:
    """The ranks are in different micro-batches at the divergence: they had begun different numbers
    of backward passes in the step when they issued its collectives, or a rank issued again a
    collective that opens each pass (first issued in the step before its first backward pass: a
    forward all-gather, a per-micro-batch count). A collective issued after each backward pass (a
    per-micro-batch metric) issued again by a rank that has run as many passes as the others is not
    another pass: its reductions were held back, the ranks are in the same micro-batch."""
    if ctx.div is None:
        return False
    events = [e for r in ctx.div.per_rank if (e := ctx.event(r)) is not None]
    return another_pass(ctx.view, events, ctx.positions())


ANOTHER_PASS_BEGUN = Requirement(
    "ranks in different micro-batches (different backward-pass counts, or a pass-opening collective issued again)",
    another_pass_begun,
)


DECLARATION = Declaration(
    "microbatch-count-mismatch",
    DESYNC | SAME_POSITION | {M.RANK_OUTSIDE},
    (GRADIENT_ACCUMULATION, ANOTHER_PASS_BEGUN),
    ev("backward_begin", "backward_end", "grad_norm", "optimizer_step_begin", "zero_grad") | {"discarded_in"} | SOURCE,
)

PATTERN = Pattern(
    id="microbatch-count-mismatch",
    title="Micro-batch count mismatch",
    fixes=(),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
