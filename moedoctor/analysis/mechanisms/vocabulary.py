"""Level 1's vocabulary: the mechanisms, the state of a waited-for rank, and one finding.

A closed set, defined only on the structure of the recorded collectives and on the ranks' states
(``detection`` finds one per divergence; ``wording`` turns a finding into the change to make). It
imports nothing of the analysis, so the report's model (``analysis.model``) can hold a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Mechanism(str, Enum):
    """What happened at a divergence, in terms of the traces' structure only (the flight recorder's
    ``MatchState`` is the model: a closed set, one value per divergence)."""

    EXTRA_COLLECTIVE = "extra-collective"
    """Some ranks issued a collective the other members never issue at that point: its call site
    appears nowhere in the others' streams of the group, or the others had ended normally, or it
    repeats the collective every rank issued just before while the others went on as the shared
    history (at least two earlier occurrences of what they issued) says, a repeat that history
    never shows. ``ranks``: those that issued it."""

    SKIPPED_COLLECTIVE = "skipped-collective"
    """Some ranks left out one or more collectives that the others issue: aligned on the history
    every rank shares up to where they part (op, call site, unit and shapes), the others issued what
    that history always issued next, and the skipping ranks issued what it puts ``m >= 1`` places
    further (their stream at k is the others' expected stream at k+m), without issuing the left-out
    ones later (that is a reordering: ``DIFFERENT_OP``). ``ranks``: those that skipped. With two
    sides, "A skipped" and "B issued an extra one" describe the same trace; the history's
    continuation decides which side is the normal one."""

    DIFFERENT_OP = "different-op"
    """The ranks issued different collectives at the same position of the group (another op, or the
    same op from another call site), each one a collective both sides issue elsewhere, and the
    history does not show one side skipping or adding one (a reordering, collectives held back, or
    a decision that took another path). Read before a loop exit or a skip where some ranks' backward
    pass ended with fewer of its reductions and they issued a collective after it while the others,
    in the same pass, issue the next reduction (``_held_back_pass``: held back past it)."""

    DIFFERENT_SHAPE = "different-shape"
    """The same collective (op and call site) at the same position, with tensors of different
    sizes. The same op from two call sites with different sizes is two collectives: ``DIFFERENT_OP``
    (or a skip or an extra one where the history shows it)."""

    DIFFERENT_DTYPE = "different-dtype"
    """Same op and sizes at the same position, with different dtypes."""

    DIFFERENT_REDUCE_OP = "different-reduce-op"
    """Same op, sizes and dtypes at the same position, with a different reduce op."""

    DIFFERENT_SPLITS = "different-splits"
    """Same op at the same position, but what one rank sends another does not expect (the split
    sizes of an all_to_all, the per-rank sizes of a gather or scatter)."""

    LOOP_TRIP_COUNT = "loop-trip-count"
    """A loop ran a different number of times on different ranks: a run (at least two in a row on
    every rank) of collectives from one call site that some ranks left after fewer iterations, or
    the step's repeated part (a pass with a backward) that some ranks began again while the others
    closed the step (or stepped: ``_stepped``), the ranks being in different passes
    (``steps.another_pass``)."""

    WAIT_CYCLE = "wait-cycle"
    """A cycle of waits across groups: each rank of the cycle waits in one group for a rank that
    waits in another group; every group's own sequence may agree."""

    UNMATCHED_P2P = "unmatched-p2p"
    """A send or recv whose peer never posted the matching op (or posted one of another size)."""

    RANK_OUTSIDE = "rank-outside-collective"
    """The ranks the others wait for are outside any collective of the group: working, stopped,
    dead or crashed (``RankState``), or in a state nothing recorded."""

    TRANSPORT_HANG = "transport-hang"
    """Every member is inside the same collective (same op, shapes, call site) and none completed it:
    nothing in the sequence differs."""


class RankState(str, Enum):
    """Where a waited-for rank is, for ``Mechanism.RANK_OUTSIDE``."""

    WORKING = "working"  # its stack shows it running outside torch.distributed
    STOPPED = "stopped"  # its process does not run (state T, t or D)
    DEAD = "dead"  # its process exited or was killed
    CRASHED = "crashed"  # it raised an exception nothing caught
    UNKNOWN = "unknown"  # no stack, no process state, no exit status


@dataclass(frozen=True)
class MechanismFinding:
    """One mechanism with where it happened: ``ranks`` are the ranks it is about (those that issued
    the extra collective, skipped one, ran the loop fewer times, the waited-for ones; empty where the
    structure singles out none), ``others`` the rest of the members; ``sites`` each side's call site."""

    mechanism: Mechanism
    group: str
    seq: int
    ranks: tuple[int, ...]
    others: tuple[int, ...]
    sites: dict[int, str] = field(default_factory=dict)  # rank -> file:line at the divergence
    functions: dict[int, str] = field(default_factory=dict)
    step: int | None = None
    phase: str | None = None
    detail: str = ""
    state: RankState | None = None  # RANK_OUTSIDE
    counts: dict[int, int] | None = None  # LOOP_TRIP_COUNT of one call site: iterations per rank
    loop_site: str | None = None

    def sentence(self) -> str:
        """``loop-trip-count at #7 of group 0 (step 2, backward): <detail>``."""
        where = ", ".join(x for x in (f"step {self.step}" if self.step is not None else "", self.phase or "") if x)
        return (
            f"{self.mechanism.value} at #{self.seq} of group {self.group}"
            + (f" ({where})" if where else "")
            + (f": {self.detail}" if self.detail else "")
        )

    def to_dict(self) -> dict:
        return {
            "mechanism": self.mechanism.value,
            "group": self.group,
            "seq": self.seq,
            "ranks": list(self.ranks),
            "others": list(self.others),
            "call_sites": {str(r): s for r, s in sorted(self.sites.items())},
            "step": self.step,
            "phase": self.phase,
            "state": self.state.value if self.state else None,
            "loop_counts": {str(r): n for r, n in sorted(self.counts.items())} if self.counts else None,
            "loop_site": self.loop_site,
            "detail": self.detail,
        }
