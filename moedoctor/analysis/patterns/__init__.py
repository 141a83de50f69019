"""The registry of deadlock patterns: one small module each.

Every module defines ``PATTERN``: its id, a title, the fix modules that address it (names that
``moedoctor verify --fix NAME`` takes), whether it is a code desync, and ``classify(ctx)``, which
returns a ``Finding`` (a score in [0, 1] and the evidence strings it used) or None. Its docstring
states the mechanism, the evidence it reads and the risk of a wrong call.

``classify_all`` runs every pattern; the analysis takes the best score, and calls it
``unknown-desync`` (listing every candidate) when the best two are tied or none reaches
``THRESHOLD``. See ``docs/analysis.md``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.mechanisms.culprits import Culprits
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding
from moedoctor.analysis.model import Divergence, DivergenceKind, OpView, Suggestion, WaitEdge
from moedoctor.analysis.evidence.source import Branch, decision_branch
from moedoctor.analysis.evidence.steps import position
from moedoctor.analysis.evidence.view import RunView
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names

#: A pattern needs at least this score to be named.
THRESHOLD = 0.4
#: Scores closer than this are a tie.
TIE = 0.01

MODULES = (
    "all_to_all_split_mismatch",
    "skipped_optimizer_step",
    "inflight_metric_allreduce",
    "uneven_dtensor_allgather",
    "inactive_experts",
    "checkpoint_recompute_mismatch",
    "collective_in_checkpointed_region",
    "rank_conditional_collective",
    "microbatch_count_mismatch",
    "collective_order_inversion",
    "shape_mismatch",
    "rank_stopped",
    "straggler",
    "not_a_desync",
    "unknown_desync",
)


@dataclass(frozen=True)
class Finding:
    score: float
    evidence: tuple[str, ...]
    culprits: tuple[int, ...] | None = None  # a pattern's own culprits, used when the generic rules found none
    suggestion: Suggestion | None = None
    #: Settings that point the pattern's fix at this job's own code (``{fix name: section}``,
    #: e.g. the ``if`` that made the rank-local decision), so ``moedoctor verify`` needs no --config.
    fix_config: dict | None = None
    #: The finding explains why the ranks the others wait for stopped issuing collectives, so it is
    #: named even when those ranks then died (a DDP reducer that raises over unused parameters).
    explains_crash: bool = False


@dataclass
class Context:
    """What a classifier sees: the run, the divergence chosen as primary, the generic culprits and
    the wait-for graph."""

    view: RunView
    div: Divergence | None
    culprits: Culprits
    edges: list[WaitEdge]
    cycle: list[WaitEdge] | None
    hang: bool

    def event(self, rank: int) -> CollectiveEvent | None:
        """The rank's collective at the divergence (None: it never issued one there)."""
        div = self.div
        if div is None:
            return None
        if div.kind == DivergenceKind.P2P and div.peers:
            a, b = div.peers
            peer = b if rank == a else a
            return self.view.p2p_peers(div.group.name).get(rank, {}).get(peer, {}).get(div.seq)
        return self.view.event(rank, div.group.name, div.seq)

    def stack(self, rank: int) -> tuple[str, ...]:
        """The job's frames (``file:line function``, innermost first) of the rank's collective at the
        divergence; empty when it issued none there."""
        event = self.event(rank)
        return () if event is None or event.call_site is None else event.call_site.stack

    def decision(self) -> Branch | None:
        """The ``if`` that sent the ranks different ways at the divergence (``source.decision_branch``):
        found from a rank's stack, confirmed by the stacks of the ranks whose call site differs."""
        return self.decision_sides()[0]

    def decision_sides(self) -> tuple[Branch | None, list[int]]:
        """``decision()`` and the ranks whose call went through it (the others went the other way).
        Found once per context: several classifiers ask."""
        return self._decision

    @functools.cached_property
    def _decision(self) -> tuple[Branch | None, list[int]]:
        if self.div is None:
            return None, []
        sites = {
            r: (e.call_site.where if (e := self.event(r)) is not None and e.call_site else None)
            for r in self.div.per_rank
        }
        found: dict[Branch, list[int]] = {}
        for rank in sorted(self.present()):
            stack = self.stack(rank)
            if not stack:
                continue
            others = tuple(self.stack(r) for r in sites if sites[r] != sites[rank] and self.stack(r))
            branch = decision_branch(stack, others)
            if branch is not None:
                found.setdefault(branch, []).append(rank)
        if not found:
            return None, []
        branch = next(iter(found))
        return branch, found[branch]

    def positions(self) -> dict[int, str | None]:
        """Where each rank that issued the divergence's collective is in its step (``steps.position``)."""
        return {r: position(self.view, e) for r in self.div.per_rank if (e := self.event(r)) is not None}

    def present(self) -> dict[int, OpView]:
        return {} if self.div is None else {r: v for r, v in self.div.per_rank.items() if v is not None}

    def desync_kind(self) -> bool:
        return self.div is not None and self.div.kind in (
            DivergenceKind.MISMATCH,
            DivergenceKind.MISSING,
            DivergenceKind.P2P,
            DivergenceKind.CONTRACT,
        )


@dataclass
class StackContext:
    """What a pattern sees of a job that left only its ranks' stacks (``analysis.from_stacks``): the
    ranks grouped by identical stack (``StackClass``), those inside a collective and those outside,
    the ranks whose process does not run (state letter), and every rank's dump."""

    stacks: dict  # rank -> StackDump
    inside: list  # StackClass, waiting in a collective
    outside: list  # StackClass, outside any collective
    frozen: dict[int, str]  # rank -> why its process does not run
    letters: dict[int, str]  # rank -> its process state letter

    def ops(self, classes) -> str:
        """The collectives ``classes`` wait in, and from where."""
        return " / ".join(dict.fromkeys(f"{c.stack.waits_in} (from {c.stack.where()})" for c in classes))


@dataclass(frozen=True)
class StackFinding:
    """What a pattern concludes from stacks alone."""

    summary: str
    culprits: list[int]
    reasoning: str
    suggestion: Suggestion | None


@dataclass(frozen=True)
class Pattern:
    id: str
    title: str
    fixes: tuple[str, ...]
    desync: bool  # a code desync (verdict desync), or a hang of another kind (stuck)
    classify: Callable[[Context], Finding | None]
    advice: str  # what to change, when the finding brings no suggestion of its own
    #: The pattern's reading of a job known only by its stacks (``moedoctor triage``, or a run that
    #: recorded nothing); None where stacks alone cannot show it. The registry's order decides.
    from_stacks: Callable[[StackContext], StackFinding | None] | None = None


def registry() -> list[Pattern]:
    return [importlib.import_module(f"{__name__}.{m}").PATTERN for m in MODULES]


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


names = rank_names  # the patterns' word for a list of ranks


def verb(ranks, singular: str, plural: str) -> str:
    return singular if len(list(ranks)) == 1 else plural


# ---- the declarations: what a pattern refines, requires and reads ------------------------------

#: Evidence the sources classifiers read.
STACKS = frozenset({"stack", "stack_frame", "in_distributed"})
PROCESS = frozenset({"process", "frozen", "frozen_ranks"})
EXCEPTION = frozenset({"exception", "exception_line"})
EXITS = frozenset({"exit_code", "died", "finished"})
STEPS = frozenset({"discarded_steps", "discarded_in", "stepped", "nonfinite_loss"})
#: The job's own source, read at the stacks' lines (``analysis.evidence.source``); declared, not
#: recorded by the test's view proxy.
SOURCE = frozenset({"source"})
#: ``moedoctor run``'s account of the silences it judged busy (``RunView.busy_records``).
BUSY = frozenset({"busy_records"})


def ev(*kinds: str) -> frozenset[str]:
    return frozenset(f"evidence:{k}" for k in kinds)


#: The mechanisms of a code desync, and those of one collective differing at one position.
DESYNC = frozenset(
    {
        Mechanism.EXTRA_COLLECTIVE,
        Mechanism.SKIPPED_COLLECTIVE,
        Mechanism.DIFFERENT_OP,
        Mechanism.LOOP_TRIP_COUNT,
        Mechanism.WAIT_CYCLE,
    }
)
SAME_POSITION = frozenset({Mechanism.DIFFERENT_SHAPE, Mechanism.DIFFERENT_DTYPE, Mechanism.DIFFERENT_REDUCE_OP})


@dataclass(frozen=True)
class Declaration:
    """Level 2's contract, in the pattern's own module (``DECLARATION``): a pattern is named only when
    the divergence's mechanism is one it ``refines`` and every evidence it ``requires`` is present;
    otherwise the report names the mechanism and says per candidate pattern what was missing.
    ``reads`` lists every source of domain evidence its classifier may read (recorder evidence
    records ``evidence:<kind>``, the ranks' ``stacks``, ``process`` states, ``exception`` records,
    ``exits``, the step-discard accessors); ``tests/unit/test_declarations.py`` checks it reads
    nothing else."""

    pattern: str
    refines: frozenset[Mechanism]
    requires: tuple[Requirement, ...]
    reads: frozenset[str] | set[str]


def declarations() -> dict[str, Declaration]:
    """Every pattern's declaration, by pattern id."""
    found = (importlib.import_module(f"{__name__}.{m}").DECLARATION for m in MODULES)
    return {d.pattern: d for d in found}


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
