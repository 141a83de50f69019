"""The live status of a run, as ``run_job`` reports it to its observer every poll: what each rank
did last and how long the collectives have been silent. A shared leaf (only ``events`` below it), so
that ``render`` draws it without importing the runner; ``runner.launch`` re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from moedoctor.events import CollectiveEvent


@dataclass
class RankStatus:
    """One rank in the live status. ``last`` is None before its first collective."""

    rank: int
    pid: int | None
    last: CollectiveEvent | None
    last_completed: bool
    idle_seconds: float | None  # None: no trace yet
    unrecorded: bool = False  # its recorder stopped (a failed write): what the trace says is old
    slow: str | None = None  # "slow, not stuck: ..." while a storm of small collectives goes on
    slow_seconds: float = 0.0  # how long that storm has lasted on this rank


@dataclass
class RunStatus:
    elapsed: float
    idle_seconds: float
    limit: float  # the timeout idle_seconds is compared with now
    ranks: list[RankStatus]
    #: Past the timeout without proof of a hang: ``busy: ...`` or ``not proven: ...`` (rank_states).
    busy: str | None = None
