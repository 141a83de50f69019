"""``shape-mismatch``: the same collective with different sizes (or dtypes, or reduce ops).

Mechanism: every rank issues the same op at the same sequence number but with tensors of different
sizes or dtypes, or a different reduce op: gradient buckets built in a non-deterministic order
(parameters kept in a set), data-dependent padding, a dtype cast on some ranks only. Gloo aborts on
the size mismatch; NCCL hangs or silently pairs unrelated buffers.

Evidence: one op at the divergence on every rank that issued it, with different shapes, dtypes or
(known) reduce ops; the more specific patterns (inactive experts, checkpoint keys) did not claim it.

Required (``size_unexplained``, its declaration below): the sizes differ for no structural reason the trace
shows. Not a variable-size collective (an all_to_all whose capacity differs is a split question,
judged by the pairwise contract), not a walk of gathers inside a checkpoint save (ranks at different
keys). Corpus 27 named this pattern confidently for both.

Risk: generic by design; it scores below the patterns that explain why the sizes differ.

Fix: make the sizes rank-invariant (agree on them first with a small all_gather and pad), and build
buckets in a deterministic order (sorted parameter names, not a set).

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 5 variants of `shape-mismatch/` (bincount
histogram, DTensor.from_local rows, eval gather padding, flat bucket, vocab shard): 5/5. Confusions
seen: it claims the c10d per-parameter sync that skips None grads (an `inactive-experts` variant)
when the skip happens in the first iteration (with an earlier iteration it drops to 0.3 with the
skipped items shown).
"""

from __future__ import annotations

from moedoctor.analysis.evidence.requirements import Requirement, checkpoint_io, gather_loop, variable_size_op
from moedoctor.analysis.evidence.steps import omission
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import SAME_POSITION, Context, Declaration, Finding, Pattern, ev


def classify(ctx: Context) -> Finding | None:
    if ctx.div is None or ctx.div.kind.value != "mismatch":
        return None
    present = ctx.present()
    ops = {v.op for v in present.values()}
    if len(ops) != 1 or len(present) < 2:
        return None
    what = []
    if len({v.shapes for v in present.values()}) > 1:
        what.append("shapes")
    if len({v.dtypes for v in present.values()}) > 1:
        what.append("dtypes")
    if len({v.reduce_op for v in present.values() if v.reduce_op}) > 1:
        what.append("reduce ops")
    if not what:
        return None
    phases = {v.phase for v in present.values()}
    sites = {v.call_site for v in present.values() if v.call_site}
    # One collective with different sizes comes from one line; different lines are different collectives.
    score = 0.45 if len(phases) == 1 and len(sites) <= 1 else 0.3
    div = ctx.div
    detail = "; ".join(
        f"rank {r}: {[list(s) for s in v.shapes]} {'/'.join(v.dtypes)}" + (f" {v.reduce_op}" if v.reduce_op else "")
        for r, v in present.items()
    )
    v = next(iter(present.values()))
    evidence = [
        f"every rank issued {next(iter(ops))} #{div.seq} of group {div.group.label()} but the "
        f"{' and '.join(what)} differ ({detail})"
    ]
    for r in present:
        skipped = omission(ctx.view, div.group.name, div.seq, r, [o for o in present if o != r])
        if skipped is not None:
            score = min(score, 0.3)
            shapes = ", ".join(f"{e.op} {[list(s) for s in e.in_shapes]}" for e in skipped.missing[:4])
            evidence.append(
                f"score 0.3: rank {r} left out {len(skipped.missing)} collective(s) that the ranks issued "
                f"at this point of their repeated sequence before and the others issue now ({shapes}): "
                "items skipped on one rank (a parameter without a gradient, a key it lacks), not one "
                "collective resized"
            )
            break
    return Finding(score, tuple(evidence), suggestion=Suggestion(v.call_site, v.function, _ADVICE))


_ADVICE = (
    "Make the collective's sizes the same on every rank: agree on them first (a small all_gather of the "
    "sizes, then pad to the maximum), and build buckets in a deterministic order (sorted names, not a set)."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


def size_unexplained(ctx, mech) -> bool:
    """The sizes differ for no structural reason the trace shows: not a variable-size collective
    (whose sizes the pairwise contract judges), and not a walk of gathers over a state's items inside
    a checkpoint save or load (ranks at different items of the walk, not one collective resized)."""
    if variable_size_op(ctx, mech):
        return False
    return not (gather_loop(ctx, mech) and checkpoint_io(ctx, mech))


SIZE_UNEXPLAINED = Requirement(
    "sizes that differ for no structural reason (not a variable-size collective, not a checkpoint's walk of gathers)",
    size_unexplained,
)


DECLARATION = Declaration(
    "shape-mismatch",
    SAME_POSITION | {M.DIFFERENT_SPLITS, M.DIFFERENT_OP},
    (SIZE_UNEXPLAINED,),
    ev("checkpoint_save_begin"),
)

PATTERN = Pattern(id="shape-mismatch", title="Shape mismatch", fixes=(), desync=True, classify=classify, advice=_ADVICE)
