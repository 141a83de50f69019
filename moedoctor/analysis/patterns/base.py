"""What a pattern module is made of: the context its classifier reads (``Context``, and
``StackContext`` for a job known only by its stacks), what it returns (``Finding``,
``StackFinding``), the ``Pattern`` record it defines and its ``Declaration`` (the mechanisms it
refines, the evidence it requires, what its classifier reads). Below the registry
(``analysis.patterns``), which imports every pattern module; a pattern module imports this one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.evidence.source import Branch, decision_branch
from moedoctor.analysis.evidence.steps import position
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.culprits import Culprits
from moedoctor.analysis.mechanisms.vocabulary import Mechanism
from moedoctor.analysis.model import Divergence, DivergenceKind, OpView, Suggestion, WaitEdge
from moedoctor.events import CollectiveEvent
from moedoctor.wording import rank_names


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
