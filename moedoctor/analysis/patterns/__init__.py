"""The registry of deadlock patterns: one small module each, in the order below.

Every module defines ``PATTERN``: its id, a title, the fix modules that address it (names that
``moedoctor verify --fix NAME`` takes), whether it is a code desync, and ``classify(ctx)``, which
returns a ``Finding`` (a score in [0, 1] and the evidence strings it used) or None; and, beside its
classifier, ``DECLARATION``: the mechanisms it refines, the evidence it requires and what its
classifier reads (the types in ``patterns.base``). Its docstring states the mechanism, the evidence
it reads and the risk of a wrong call.

``classify_all`` runs every pattern; the analysis takes the best score among those whose
declaration admits them (``missing``), and calls it ``unknown-desync`` (listing every candidate)
when the best two are tied or none reaches ``THRESHOLD``. See ``docs/analysis.md``.
"""

from __future__ import annotations

from moedoctor.analysis.mechanisms.vocabulary import MechanismFinding
from moedoctor.analysis.patterns import (
    all_to_all_split_mismatch,
    skipped_optimizer_step,
    inflight_metric_allreduce,
    uneven_dtensor_allgather,
    inactive_experts,
    checkpoint_recompute_mismatch,
    collective_in_checkpointed_region,
    rank_conditional_collective,
    microbatch_count_mismatch,
    collective_order_inversion,
    shape_mismatch,
    rank_stopped,
    straggler,
    not_a_desync,
    unknown_desync,
)
from moedoctor.analysis.patterns.base import Context, Declaration, Finding, Pattern, StackContext, StackFinding

#: A pattern needs at least this score to be named.
THRESHOLD = 0.4
#: Scores closer than this are a tie.
TIE = 0.01

#: The registry's order (the first pattern that reads a job's stacks as its own names it).
_MODULES = (
    all_to_all_split_mismatch,
    skipped_optimizer_step,
    inflight_metric_allreduce,
    uneven_dtensor_allgather,
    inactive_experts,
    checkpoint_recompute_mismatch,
    collective_in_checkpointed_region,
    rank_conditional_collective,
    microbatch_count_mismatch,
    collective_order_inversion,
    shape_mismatch,
    rank_stopped,
    straggler,
    not_a_desync,
    unknown_desync,
)
MODULES = tuple(m.__name__.rpartition(".")[2] for m in _MODULES)


def registry() -> list[Pattern]:
    return [m.PATTERN for m in _MODULES]


def from_stacks(ctx: StackContext) -> tuple[Pattern, StackFinding] | None:
    """The first pattern, in the registry's order, that reads the stacks as its own."""
    for pattern in registry():
        if pattern.from_stacks is not None:
            finding = pattern.from_stacks(ctx)
            if finding is not None:
                return pattern, finding
    return None


def by_id(pattern_id: str) -> Pattern:
    return next(p for p in registry() if p.id == pattern_id)


def classify_all(ctx: Context) -> list[tuple[Pattern, Finding]]:
    """Every pattern's finding, best first (ties by id, so the order is stable)."""
    found = []
    for pattern in registry():
        finding = pattern.classify(ctx)
        if finding is not None and finding.score > 0:
            found.append((pattern, finding))
    return sorted(found, key=lambda pf: (-pf[1].score, pf[0].id))


def declarations() -> dict[str, Declaration]:
    """Every pattern's declaration, by pattern id."""
    return {m.DECLARATION.pattern: m.DECLARATION for m in _MODULES}


def missing(pattern: str, ctx, mech: MechanismFinding | None) -> list[str]:
    """What keeps ``pattern`` from being named here: the mechanism it does not refine, or each piece
    of required evidence that is absent (empty: admitted)."""
    decl = declarations().get(pattern)
    if decl is None:
        return [f"{pattern} declares nothing"]
    if mech is not None and mech.mechanism not in decl.refines:
        return [f"a mechanism it refines (this one is {mech.mechanism.value})"]
    return [r.name for r in decl.requires if not r.holds(ctx, mech)]


def admits(pattern: str, mech: MechanismFinding) -> bool:
    """Whether ``pattern`` refines ``mech`` (the part of its declaration that needs no traces: a job
    known only by its stacks)."""
    decl = declarations().get(pattern)
    return decl is not None and mech.mechanism in decl.refines
