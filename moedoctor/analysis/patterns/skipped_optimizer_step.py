"""``skipped-optimizer-step``: some ranks skip ``optimizer.step()`` whose step issues collectives.

Mechanism: a rank-local decision (a non-finite gradient norm computed from local shards, a local
NaN check, an unsharded grad scaler) makes some ranks skip ``optimizer.step()`` while the others run
it; the step is collective (sharded optimizers all-reduce the norm or gather the updated shards),
so the stepping ranks wait in it while the skipping ranks are already in the next iteration.

Evidence: at the divergence, ranks inside ``Optimizer.step`` (phase ``optimizer``) face ranks in
another phase (forward / backward of the next iteration) or ranks that never issued it; the other
ranks logged a non-finite ``grad_norm`` at that step while the stepping ranks' norms were finite;
they never began that optimizer step (no ``optimizer_step_begin``).

Risk: a step that is skipped collectively on purpose never diverges, so it cannot be confused; a
rank that is merely late into the optimizer shows no non-finite norm and scores lower.

Fix ``skip-step-collectively``: all-reduce the non-finite flag with MAX over the group, so every rank
skips or none does (zeroed grads are not a no-op for AdamW: weight decay and momentum still move it).
"""

from __future__ import annotations

from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns import Context, Finding, Pattern, names, verb
from moedoctor.events import Evidence


def _nonfinite(ev: Evidence) -> bool:
    return ev.data.get("finite") is False or str(ev.data.get("norm")).lower() in ("inf", "-inf", "nan")


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind():
        return None
    div, view = ctx.div, ctx.view
    present = ctx.present()
    stepping = sorted(r for r, v in present.items() if v.phase == "optimizer")
    skipping = sorted(r for r in div.per_rank if r not in stepping)
    if not skipping:
        return None
    steps = {present[r].step for r in stepping} or {v.step for v in present.values()}
    score, evidence = 0.0, []
    if stepping:
        v = present[stepping[0]]
        elsewhere = "; ".join(
            f"rank {r} " + ("never issued it" if div.per_rank[r] is None else
                            f"issued {div.per_rank[r].op} ({div.per_rank[r].short_site}, {div.per_rank[r].phase})")
            for r in skipping[:4])
        score += 0.3
        evidence.append(f"at #{div.seq} of group {div.group.label()} {names(stepping)} "
                        f"{verb(stepping, 'is', 'are')} inside Optimizer.step ({v.op} from {v.short_site}) "
                        f"while {elsewhere}")
        # The skipping ranks finished this step's gradients (they computed its norm) before moving on.
        finished = [r for r in skipping if any(
            e.step in steps and (div.per_rank[r] is None or e.time < div.per_rank[r].time)
            for e in view.evidence(r, "grad_norm"))]
        if finished and len(finished) == len(skipping):
            score += 0.2
            evidence.append(f"{names(finished)} had finished step {min(steps)}'s gradients (grad norm computed) "
                            "and went on without the optimizer step")
    nonfinite = {r: [e for e in view.evidence(r, "grad_norm") if e.step in steps and _nonfinite(e)]
                 for r in div.per_rank}
    bad = sorted(r for r in skipping if nonfinite[r])
    if bad and not any(nonfinite[r] for r in stepping):
        e = nonfinite[bad[0]][0]
        score += 0.35
        site = e.data.get("site")
        evidence.append(f"{names(bad)} computed a non-finite local gradient norm ({e.data.get('norm')}) at step "
                        f"{e.step}{f' ({site})' if site else ''}; "
                        f"{names(stepping) if stepping else 'the other ranks'} had finite norms")
    began = {r: any(e.step in steps for e in view.evidence(r, "optimizer_step_begin")) for r in div.per_rank}
    if stepping and all(began[r] for r in stepping) and any(not began[r] for r in skipping):
        never = sorted(r for r in skipping if not began[r])
        score += 0.15
        evidence.append(f"{names(never)} never began optimizer step {min(steps)} (no optimizer_step_begin); "
                        f"{names(stepping)} did")
    if score == 0:
        return None
    suggestion = None
    if bad:
        site = nonfinite[bad[0]][0].data.get("site")
        if isinstance(site, str) and ":" in site:
            suggestion = Suggestion(site, None, _ADVICE)
    elif stepping:
        v = present[stepping[0]]
        suggestion = Suggestion(v.call_site, v.function, _ADVICE)
    return Finding(round(score, 3), tuple(evidence), culprits=tuple(bad or skipping), suggestion=suggestion)


_ADVICE = ("Decide to skip collectively: all_reduce the non-finite flag (a 0/1 tensor) with ReduceOp.MAX over "
           "the optimizer's group before the decision, so every rank skips optimizer.step() or none does. "
           "Zeroing the grads instead is not a no-op for AdamW (weight decay and momentum still move the weights).")

PATTERN = Pattern(
    id="skipped-optimizer-step", title="Skipped optimizer step", fixes=("skip-step-collectively",), desync=True,
    classify=classify, advice=_ADVICE,
)
