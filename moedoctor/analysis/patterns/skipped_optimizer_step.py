"""``skipped-optimizer-step``: some ranks skip ``optimizer.step()`` whose step issues collectives.

Mechanism: a rank-local decision (a non-finite gradient norm computed from local shards, a local
NaN check, an unsharded grad scaler) makes some ranks skip ``optimizer.step()`` while the others run
it; the step is collective (sharded optimizers all-reduce the norm or gather the updated shards),
so the stepping ranks wait in it while the skipping ranks are already in the next iteration.

Evidence (the recorder's optimizer-step, ``zero_grad``, backward and norm hooks; no names): in the
step where the ranks parted, some ranks began ``optimizer.step`` and the others did not although
they finished the backward pass; the skipping ranks cleared their gradients (``zero_grad``) after
that backward without stepping (a delayed rank or an extra micro-batch never clears); they computed
a non-finite loss or local gradient norm there while the stepping ranks' were finite; the stepping
ranks are inside ``Optimizer.step`` at the divergence. Both sides of a step are needed, and at
least one sign of a skip (a discard or a non-finite value) to reach the naming threshold.

Risk: a step that is skipped collectively on purpose never diverges, so it cannot be confused; a
rank that is merely late into the optimizer shows no non-finite norm and scores lower.

Fix ``skip-step-collectively``: all-reduce the non-finite flag with MAX over the group, so every rank
skips or none does (zeroed grads are not a no-op for AdamW: weight decay and momentum still move it).

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 7 variants of `skipped-optimizer-step/`
(Megatron-style distributed optimizer, FSDP2 trainer, functional step hook, Muon at step 0,
PostLocalSGD, TP+DP loss scaler, ZeRO NaN guard): 7/7, culprits 7/7, and the printed verify
passes on 7/7 (the decision's `if`, found from the stacks, made collective). Confusions seen before:
0/7, named `microbatch-count-mismatch` (4) or `inflight-metric-allreduce` (2), one unknown; the
hand-written optimizer that is no `torch.optim.Optimizer` (no step or zero_grad hook fires) stayed
`unknown-desync` until the sides were taken from the rank-local inf/NaN check the ranks' stacks are
on either side of. On NCCL `funcol_sync_in_step_hook` was named `microbatch-count-mismatch` (the
skipping rank ran on and completed the same step counter in its next iteration, which read as a habit
of clearing between micro-batches); with the habit rule limited to earlier steps it is
`unknown-desync` with the right culprit, no longer a confident wrong call.

Evidence from the code: the `if` that separates the ranks (`Context.decision_sides`: in the stack of
a rank that issued the step's collective, confirmed by the stacks of those that issued something
else, or unconfirmed where their stacks are not in that function); when its test checks for inf/NaN
(`torch.isfinite`, `math.isnan`, directly, through one assignment, one function of the same file, or
an assignment that calls one: `overflow = self.scaler.has_overflow(buf)`), it weighs 0.45 and, where
no optimizer hook fired, decides which ranks stepped (held-out `zero1_fp16_loss_scaler`: a
hand-written ZeRO-1 with a loss scaler, the skipping rank aborted by Gloo).
"""

from __future__ import annotations

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.evidence.source import checks_finiteness, finite_side
from moedoctor.analysis.evidence.steps import CLOSING, RESTART
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import (
    DESYNC,
    SAME_POSITION,
    SOURCE,
    STEPS,
    Context,
    Declaration,
    Finding,
    Pattern,
    ev,
    names,
    verb,
)
from moedoctor.events import Evidence
from moedoctor.wording import phase_label


def _nonfinite(ev: Evidence) -> bool:
    return ev.data.get("finite") is False or str(ev.data.get("norm")).lower() in ("inf", "-inf", "nan")


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind():
        return None
    div, view = ctx.div, ctx.view
    present = ctx.present()
    ranks = sorted(div.per_rank)
    # The step the ranks were in when they parted: a stepping rank's counter moves on after its
    # step, a skipping rank's does not, so the smallest counter at the divergence is that step.
    step = min((v.step for v in present.values()), default=0)
    stepped = sorted(r for r in ranks if view.stepped(r, step))
    phase_stepping = sorted(r for r, v in present.items() if v.phase == "optimizer")
    stepping = sorted(set(stepped) | set(phase_stepping))
    discarded = {r: view.discarded_in(r, step) for r in ranks}
    cleared = sorted(r for r in ranks if discarded[r] and r not in stepping)
    if not stepping and cleared and len(cleared) < len(ranks):
        # Nobody has stepped yet (the others are in the step's closing collectives, before step()):
        # the ranks that threw their gradients away are the skipping side.
        stepping = sorted(r for r in ranks if r not in cleared)
    skipping = sorted(r for r in ranks if r not in stepping)
    branch, through = ctx.decision_sides()
    finite_check = branch is not None and checks_finiteness(branch)
    score, evidence = 0.0, []
    if finite_check and 0 < len(through) < len(ranks):
        # The ranks' stacks are on either side of a rank-local inf/NaN check: the ranks whose call is on
        # the `if`'s side that issues the step's collectives stepped, unless the test's polarity says
        # that side is the non-finite one.
        side = finite_side(branch)
        by_branch = sorted(through) if side is not False else sorted(r for r in ranks if r not in through)
        if not skipping or not stepping:
            # No optimizer hook fired (an optimizer that is no torch.optim.Optimizer).
            stepping = by_branch
        elif side is not None and not set(stepping) & set(by_branch):
            # The hooks count the first optimizer's steps; the step skipped here is another one (an
            # outer optimizer, a hand-written update), and the rank that skipped it ran ahead into
            # the next iteration's first-optimizer step: the check decides the sides.
            evidence.append(
                f"the optimizer hooks show {names(stepping)} starting step {step}, but by running ahead: "
                f"{names(by_branch)} {verb(by_branch, 'is', 'are')} past the finite side of the check "
                "below, in the step it guards"
            )
            stepping, stepped = by_branch, []
        skipping = sorted(r for r in ranks if r not in stepping)
    if not skipping or not stepping:
        return None
    if finite_check:
        score += 0.45
        evidence.append(
            f"the ranks parted at a rank-local check for inf/NaN, `if {branch.test}:` ({branch.short}): "
            f"{names(stepping)} went the way that steps, {names(skipping)} the other"
        )
    backward = [r for r in skipping if view.evidence(r, "backward_begin", step)]
    if stepped and len(backward) == len(skipping):
        score += 0.25
        evidence.append(
            f"in step {step} {names(stepped)} ran optimizer.step (optimizer step hooks) and "
            f"{names(skipping)} did not, after {'its' if len(skipping) == 1 else 'their'} backward pass"
        )
    where = ctx.positions()
    if (
        all(where.get(r) == RESTART for r in skipping if r in where)
        and any(r in where for r in skipping)
        and all(where.get(r) == CLOSING for r in stepping if r in where)
    ):
        score += 0.15
        evidence.append(
            f"{names(skipping)} issued again a collective of the step's beginning while "
            f"{names(stepping)} issued one not issued yet in step {step} (closing it)"
        )
    cleared = [r for r in cleared if r in skipping]
    if cleared and not any(discarded[r] for r in stepping):
        score += 0.35
        evidence.append(
            f"{names(cleared)} cleared {'its' if len(cleared) == 1 else 'their'} gradients "
            f"(zero_grad) after the step {step} backward pass without calling optimizer.step: "
            "the step was skipped, not delayed"
        )
    if phase_stepping:
        v = present[phase_stepping[0]]
        elsewhere = "; ".join(
            f"rank {r} "
            + (
                "never issued it"
                if div.per_rank[r] is None
                else f"issued {div.per_rank[r].op} ({div.per_rank[r].short_site}, {phase_label(div.per_rank[r].phase)})"
            )
            for r in skipping[:4]
        )
        score += 0.1
        evidence.append(
            f"at #{div.seq} of group {div.group.label()} {names(phase_stepping)} "
            f"{verb(phase_stepping, 'is', 'are')} inside Optimizer.step ({v.op} from {v.short_site}) "
            f"while {elsewhere}"
        )
    nonfinite = {
        r: [e for e in view.evidence(r, "grad_norm", step) if _nonfinite(e)] + view.nonfinite_loss(r, step)
        for r in ranks
    }
    bad = sorted(r for r in skipping if nonfinite[r])
    if bad and not any(nonfinite[r] for r in stepping):
        record = nonfinite[bad[0]][0]
        value = record.data.get("norm", record.data.get("value"))
        score += 0.35
        site = record.data.get("site")
        what = "loss" if record.kind == "loss" else "local gradient norm"
        evidence.append(
            f"{names(bad)} computed a non-finite {what} ({value}) at step {record.step}"
            f"{f' ({site})' if site else ''}; {names(stepping)} had finite ones"
        )
    if score < 0.3:
        return None  # ranks that parted around a step, with nothing that says a step was skipped
    suggestion = None
    site = nonfinite[bad[0]][0].data.get("site") if bad else None
    if isinstance(site, str) and ":" in site:
        suggestion = Suggestion(site, None, _ADVICE)
    elif phase_stepping:
        v = present[phase_stepping[0]]
        suggestion = Suggestion(v.call_site, v.function, _ADVICE)
    fix_config = None
    if branch is not None:
        # Skip together: the collectives run only if every rank's test lets them.
        agree = "all" if branch.runs_when else "any"
        taken = "steps" if branch.runs_when else "skips"
        if not finite_check:
            evidence.append(
                f"the decision is `if {branch.test}:` ({branch.short}): {names(stepping)} went the way "
                f"that steps, {names(skipping)} the other; the test is rank-local (its value is no "
                "collective)"
            )
        fix_config = {
            "skip-step-collectively": {
                "branch": {"file": branch.file, "line": branch.line, "agree": agree, "test": branch.test}
            }
        }
        suggestion = Suggestion(
            f"{branch.file}:{branch.line}",
            None,
            f"Make this decision collective: all_reduce its 0/1 value over the group "
            f"(ReduceOp.{'MAX' if agree == 'any' else 'MIN'}) before the `if`, so every rank "
            f"{taken} when {'any' if agree == 'any' else 'all'} of them would. " + _ADVICE,
        )
    return Finding(
        round(min(score, 1.0), 3),
        tuple(evidence),
        culprits=tuple(bad or cleared or skipping),
        suggestion=suggestion,
        fix_config=fix_config,
    )


_ADVICE = (
    "Decide to skip collectively: all_reduce the non-finite flag (a 0/1 tensor) with ReduceOp.MAX over "
    "the optimizer's group before the decision, so every rank skips optimizer.step() or none does. "
    "Zeroing the grads instead is not a no-op for AdamW (weight decay and momentum still move the weights)."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


def optimizer_step_signs(ctx, mech) -> bool:
    """The optimizer's own hooks or values: a rank began ``optimizer.step`` or cleared its gradients,
    a non-finite loss or gradient norm, a discarded step, or an inf/NaN test separating the ranks."""
    if ctx.div is None:
        return False
    view = ctx.view
    for r in ctx.div.per_rank:
        if view.evidence(r, "optimizer_step_begin") or view.evidence(r, "zero_grad") or view.discarded_steps(r):
            return True
        if any(str(e.data.get("finite")).lower() == "false" for e in view.evidence(r, "grad_norm")):
            return True
        if any(view.nonfinite_loss(r, s) for s in {e.step for e in view.evidence(r, "loss")}):
            return True
    branch = ctx.decision()
    return branch is not None and checks_finiteness(branch)


OPTIMIZER_STEP_SIGNS = Requirement(
    "optimizer-step evidence (step or zero_grad hooks, a non-finite value, a discarded step, an inf/NaN test)",
    optimizer_step_signs,
)


DECLARATION = Declaration(
    "skipped-optimizer-step",
    DESYNC | SAME_POSITION | {M.RANK_OUTSIDE},
    (OPTIMIZER_STEP_SIGNS,),
    ev("backward_begin", "grad_norm", "loss", "optimizer_step_begin", "zero_grad") | STEPS | SOURCE,
)

PATTERN = Pattern(
    id="skipped-optimizer-step",
    title="Skipped optimizer step",
    fixes=("skip-step-collectively",),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
