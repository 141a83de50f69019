"""What ``load_run`` returns: ``RunData`` (the input of ``analyze``) and its parts, the manifest's
account of the run and the GPUs' snapshots. Defined here, below both readers (``load`` and the
streaming ``scan``), so that neither has to import the other to name them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.run_records import BusyRecord, HangRecord, RankExit, StackDump
from moedoctor.trace.reader import RankTrace


class SourceKind:
    RUN_DIR = "run-dir"
    TRACES = "traces"
    FLIGHT_RECORDER = "flight-recorder"


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    name: str | None
    utilization: int | None  # percent, GPU
    memory_used: int | None
    memory_total: int | None
    ecc_uncorrected: int | None  # volatile uncorrected ECC errors
    retired_pending: bool | None
    remapped_failure: bool | None
    processes: int


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """``gpu/<host>.json``: NVML's view of one node when the hang was declared."""

    host: str
    available: bool
    reason: str | None
    devices: tuple[GpuDevice, ...] = ()


@dataclass
class ManifestInfo:
    """What the analysis uses of ``manifest.json``."""

    status: str | None
    hang: HangRecord | None
    exits: dict[int, RankExit]
    world_size: int | None
    coverage_gaps: list[str] = field(default_factory=list)
    launcher_exits: list[int | None] = field(default_factory=list)  # one per node
    command: list[str] | None = None  # the launch command (the job's script names its ``__main__``)
    #: Silences of the collectives the supervisor judged not a hang (busy, or unproven).
    busy: list[BusyRecord] = field(default_factory=list)
    #: Supervisors that died without recording the run's end (``kill -9``): the manifest still says
    #: ``running`` and no process holds the run directory's lock. One ``moedoctor pid N on HOST`` each.
    lost_supervisors: list[str] = field(default_factory=list)
    #: When the run was interrupted: the node's recorded end (Ctrl-C), or, for a lost supervisor, the
    #: last write of anything in the run directory (its job was stopped with it within a second).
    stopped_at: float | None = None

    @property
    def interrupted(self) -> bool:
        """The run did not end by itself: moedoctor was interrupted (Ctrl-C, SIGTERM) and stopped the
        job, or it was killed (the job was stopped with it), before any hang was declared."""
        return self.hang is None and (self.status == "interrupted" or bool(self.lost_supervisors))

    def interruption(self) -> str:
        """``moedoctor (pid 12 on vm) died without recording how the run ended (kill -9?) ...``."""
        import time

        at = f" at about {time.strftime('%H:%M:%S %Z', time.localtime(self.stopped_at))}" if self.stopped_at else ""
        if self.lost_supervisors:
            at += " (the run directory's last write)" if at else ""
            return (
                f"the run was interrupted: its supervisor ({', '.join(self.lost_supervisors[:4])}) died{at} "
                "without recording how the run ended (kill -9?), and the job was stopped with it"
            )
        return f"the run was interrupted: moedoctor was stopped (Ctrl-C or SIGTERM){at} and stopped the job"


@dataclass
class RunData:
    """The input of ``analyze``.

    ``last_seq[rank][group]`` is the last collective sequence number each rank issued on each group
    and ``last_p2p[rank][(group, peer)]`` the last p2p sequence number per peer: exact even when
    ``windowed`` (then ``traces`` hold only the events around the divergence and at each file's
    end). ``open_ended`` ranks have traces that stop before the rank did (event cap): beyond their
    last event nothing is known, so they are never counted as missing there."""

    path: Path
    kind: str
    traces: list[RankTrace]
    world_size: int | None = None
    stacks: dict[int, StackDump] = field(default_factory=dict)
    gpus: list[GpuSnapshot] = field(default_factory=list)
    manifest: ManifestInfo | None = None
    incomplete: list[str] = field(default_factory=list)
    last_seq: dict[int, dict[str, int]] = field(default_factory=dict)
    last_p2p: dict[int, dict[tuple[str, int], int]] = field(default_factory=dict)
    open_ended: set[int] = field(default_factory=set)
    windowed: bool = False
    #: Ranks whose recorder stopped on a failed write of its own (disk full), with its status line:
    #: open-ended too, and a verdict of healthy has no evidence behind it.
    recording_stopped: dict[int, str] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(t.rank for t in self.traces)

    @property
    def trace_of(self) -> dict[int, RankTrace]:
        return {t.rank: t for t in self.traces}
