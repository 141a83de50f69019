"""``unknown-desync``: the ranks diverged, and no known pattern explains it.

Mechanism: any collective desync; this pattern is the fallback the analysis names when no other
pattern reaches the threshold or the best two tie (then every candidate is listed with its
evidence).

Evidence: a divergence (mismatch, missing ranks or an unmatched p2p op) and nothing more specific;
with it, the structural account of what differed (``structure_account``): where each rank is in
its step, a loop one side left early, items one rank left out, steps whose gradients were thrown
away, a rank branch around a collective, and whether the optimizer hooks fired at all.

Risk: none in naming it; the divergence, culprits and call sites are still reported.

Fix: none to name; read the side-by-side table around the divergence.
"""

from __future__ import annotations

from moedoctor.analysis.evidence.source import rank_guard
from moedoctor.analysis.evidence.steps import CLOSING, RESTART, loop_exit, omission
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import (
    SOURCE,
    Context,
    Declaration,
    Finding,
    Pattern,
    StackContext,
    StackFinding,
    ev,
    names,
)


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind():
        return None
    div = ctx.div
    per = "; ".join(
        f"rank {r}: " + ("nothing" if v is None else v.describe()) for r, v in list(div.per_rank.items())[:6]
    )
    culprit = next((v for r, v in div.per_rank.items() if r in ctx.culprits.ranks and v is not None), None)
    culprit = culprit or next((v for v in div.per_rank.values() if v is not None), None)
    evidence = [f"group {div.group.label()} diverges at #{div.seq}: {per}"]
    evidence.extend(structure_account(ctx))
    silent = [r for r in div.missing if ctx.view.stack(r) is None and not ctx.view.died(r)]
    if silent:
        evidence.append(
            f"without a stack of {names(silent)} it cannot be told whether "
            f"{'it is' if len(silent) == 1 else 'they are'} stuck in other code (a straggler) or skipped "
            "the collective (a desync)"
        )
    return Finding(
        0.2,
        tuple(evidence),
        suggestion=Suggestion(culprit.call_site if culprit else None, culprit.function if culprit else None, _ADVICE),
    )


def structure_account(ctx: Context) -> list[str]:
    """What the ranks' own streams, hooks and code say differed, whatever the pattern: where each rank
    is in its step, a loop left early, items left out, steps thrown away, rank branches."""
    div, view = ctx.div, ctx.view
    lines = []
    where = ctx.positions()
    restart = sorted(r for r, p in where.items() if p == RESTART)
    closing = sorted(r for r, p in where.items() if p == CLOSING)
    if restart and closing:
        lines.append(
            f"in their step, {names(restart)} issued again a collective already issued in it after a backward "
            f"pass (another pass over the step's repeated part) while {names(closing)} issued one not issued "
            "yet (closing the step)"
        )
    ex = loop_exit(view, div.group.name, div.seq, list(div.per_rank))
    if ex is not None:
        lines.append(
            f"{names(ex.left)} left a loop of collectives from {ex.short} after fewer iterations than "
            f"{names(ex.looping)} (" + ", ".join(f"rank {r}: {n}" for r, n in sorted(ex.counts.items())) + ")"
        )
    present = [r for r in div.per_rank if div.per_rank[r] is not None]
    for r in present:
        skipped = omission(view, div.group.name, div.seq, r, [o for o in present if o != r])
        if skipped is not None:
            lines.append(
                f"rank {r} left out {len(skipped.missing)} collective(s) that the ranks issued at this point "
                "of their repeated sequence before"
            )
            break
    steps = {v.step for v in div.per_rank.values() if v is not None}
    thrown = sorted(r for r in div.per_rank if any(view.discarded_in(r, s) for s in steps))
    if thrown:
        lines.append(
            f"{names(thrown)} cleared gradients after a backward pass without an optimizer step "
            f"(zero_grad) in step {min(steps)}"
        )
    for r in present:
        guard = rank_guard(ctx.stack(r))
        if guard is not None:
            lines.append(
                f"rank {r}'s collective is issued under `{guard.kind} {guard.text}` ({guard.short}), "
                "a branch on the rank"
            )
            break
    if not any(view.evidence(r, "optimizer_step_begin") for r in div.per_rank):
        lines.append(
            "no optimizer step hook fired on these ranks (an optimizer that is no torch.optim.Optimizer, "
            "or the first step): skipped or extra steps cannot be told from the stream"
        )
    return lines


_ADVICE = (
    "Make this collective unconditional and identical on every rank of the group: compare the call sites "
    "in the table above and find the rank-dependent branch, loop count or size between them."
)


def from_stacks(ctx: StackContext) -> StackFinding | None:
    """Ranks inside different collectives, or the same one from different call sites: a code desync,
    whose pattern needs the sequence of collectives."""
    inside = ctx.inside
    if len({c.stack.collective for c in inside}) <= 1 and len({_site(c.stack) for c in inside}) <= 1:
        return None
    differ = (
        "different collectives"
        if len({c.stack.collective for c in inside}) > 1
        else f"{inside[0].stack.collective} from different call sites"
    )
    summary = (
        f"Code desync: ranks wait in {differ} ("
        + " vs ".join(f"{names(c.ranks)} in {c.stack.waits_in} from {c.stack.where()}" for c in inside)
        + "). Which pattern it is needs the sequence of collectives: run the job under moedoctor "
        "run, or with Flight Recorder dumps."
    )
    culprits: list[int] = []
    if len(inside) > 1 and len(inside[0].ranks) > len(inside[1].ranks):
        culprits = sorted(r for c in inside[1:] for r in c.ranks)
        reasoning = f"{names(culprits)}: the odd ones out (the other ranks agree)"
    else:
        reasoning = "undetermined: no majority among the ranks' collectives"
    suggestion = Suggestion(
        None,
        None,
        "The ranks issued different collectives: find the branch, loop count "
        "or size that depends on rank-local data on the way to these call sites, and make "
        "the collective unconditional and identical on every rank of the group. To name the "
        "pattern and the first diverging collective, record the job with moedoctor run.",
    )
    return StackFinding(summary, culprits, reasoning, suggestion)


def _site(stack) -> str | None:
    f = stack.user_frame
    return None if f is None else f"{f.file}:{f.line}"


# ---- what it refines, the evidence it requires and what its classifier reads ---------------------

DECLARATION = Declaration(
    "unknown-desync",
    frozenset(M),
    (),
    ev("backward_begin", "optimizer_step_begin") | {"died", "stack", "discarded_in"} | SOURCE,
)

PATTERN = Pattern(
    id="unknown-desync",
    title="Unknown desync",
    fixes=(),
    desync=True,
    classify=classify,
    advice=_ADVICE,
    from_stacks=from_stacks,
)
