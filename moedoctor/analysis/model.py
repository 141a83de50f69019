"""The typed records the analysis returns: a ``Report`` and its parts.

Renderers (``moedoctor.render``) turn a ``Report`` into a terminal page, JSON, HTML or a Perfetto
trace; nothing here prints. ``docs/report-format.md`` documents the JSON form field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from moedoctor.analysis.evidence.timing import SlowReport
from moedoctor.analysis.mechanisms.vocabulary import MechanismFinding
from moedoctor.events import CollectiveEvent
from moedoctor.run_records import BusyRecord
from moedoctor.wording import phase_label

#: Bumped when a field of the JSON report changes meaning or type, or is removed.
SCHEMA_VERSION = 1


class Verdict(str, Enum):
    """What happened to the job, in one word."""

    HEALTHY = "healthy"  # every group's collectives agree across ranks and nothing is stuck
    DESYNC = "desync"  # ranks of a group stopped issuing the same collectives
    STUCK = "stuck"  # the job hangs, but not because of a desync (straggler, hardware)
    CRASHED = "crashed"  # a rank died (non-zero exit or a signal); the pattern says why, if known
    SLOW = "slow"  # silent collectives, but the ranks waited on were working and progressing: busy, not stuck
    #: The run was interrupted (moedoctor stopped by Ctrl-C, or killed: the job stopped with it) and the
    #: traces show nothing wrong up to then: no verdict on the job (``analyze`` exits 2).
    INTERRUPTED = "interrupted"


class DivergenceKind(str, Enum):
    """How the ranks of a group disagree at one sequence number."""

    MISMATCH = "mismatch"  # ranks issued different collectives (op, shapes, dtypes or reduce op)
    MISSING = "missing"  # some ranks issued it, the others never did (they stopped earlier)
    STALLED = "stalled"  # every rank is inside this same collective and none completed it
    P2P = "p2p"  # a send has no matching recv on its peer (or the shapes differ)
    CONTRACT = "contract"  # same op, but what one rank sends another does not expect (all_to_all splits)


@dataclass(frozen=True, slots=True)
class OpView:
    """One rank's collective as a report shows it."""

    seq: int
    op: str
    shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    reduce_op: str | None
    call_site: str | None  # "file:line", the file as recorded
    function: str | None
    phase: str
    step: int
    module: str | None
    completed: bool
    time: float
    peer: int | None = None
    root: int | None = None
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # all_to_all_single: (input, output)

    @classmethod
    def of(cls, event: CollectiveEvent) -> OpView:
        site = event.call_site
        return cls(
            seq=event.p2p_seq if event.is_p2p and event.p2p_seq is not None else event.seq,
            op=event.op,
            shapes=event.in_shapes,
            out_shapes=event.out_shapes,
            dtypes=event.dtypes,
            reduce_op=event.reduce_op,
            call_site=None if site is None else site.where,
            function=None if site is None else site.function,
            phase=event.phase.value,
            step=event.step,
            module=event.module,
            completed=event.completed is not None,
            time=event.time,
            peer=event.peer,
            root=event.root,
            splits=None if event.out_splits is None else (event.in_splits or (), event.out_splits),
        )

    @property
    def short_site(self) -> str | None:
        return None if self.call_site is None else self.call_site.rsplit("/", 1)[-1]

    @property
    def numel(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def describe(self) -> str:
        """``all_reduce #30 [1] float32 (sharded_optim.py:45, optimizer, step 2)``."""
        shapes = ", ".join(str(list(s)) for s in self.shapes) or "no tensors"
        where = ", ".join(x for x in (self.short_site, phase_label(self.phase), f"step {self.step}") if x)
        return f"{self.op} #{self.seq} {shapes} {'/'.join(self.dtypes)} ({where})"


@dataclass(frozen=True, slots=True)
class GroupRef:
    name: str
    desc: str
    ranks: tuple[int, ...]

    def label(self) -> str:
        return f"{self.name} ({self.desc})" if self.desc and self.desc != self.name else self.name


@dataclass
class Divergence:
    """The first place where the ranks of one group disagree (or, ``STALLED``, all sit).

    ``per_rank`` maps every traced member to its op at ``seq`` (None: it never issued it);
    ``classes`` groups the ranks that did the same thing there, largest first (``CONTRACT``: the
    ranks that keep the contract, then those that break it); ``missing`` are the
    ranks that never reached ``seq``. For ``P2P``, ``seq`` is the pair's p2p sequence number and
    ``peers`` the two ranks."""

    kind: DivergenceKind
    group: GroupRef
    seq: int
    per_rank: dict[int, OpView | None]
    classes: list[tuple[int, ...]] = field(default_factory=list)
    missing: tuple[int, ...] = ()
    peers: tuple[int, int] | None = None
    breaches: tuple[str, ...] = ()  # CONTRACT: each pair that disagrees, as a sentence

    @property
    def earliest(self) -> float:
        times = [v.time for v in self.per_rank.values() if v is not None]
        return min(times) if times else float("inf")

    def describe(self) -> str:
        where = f"p2p #{self.seq} between ranks {self.peers[0]} and {self.peers[1]}" if self.peers else f"#{self.seq}"
        return f"group {self.group.label()} {where}: {self.kind.value}"


@dataclass(frozen=True, slots=True)
class WaitEdge:
    """``rank`` is blocked in ``op`` #``seq`` of ``group`` waiting for ``waits_for``, which never issued it."""

    rank: int
    group: str
    seq: int
    op: str
    waits_for: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One pattern's claim on the divergence: a score in [0, 1] and the evidence it used."""

    pattern: str
    score: float
    evidence: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Suggestion:
    """What to change, and where."""

    call_site: str | None
    function: str | None
    text: str
    source_line: str | None = None


@dataclass(frozen=True, slots=True)
class RankSummary:
    """One rank at the end of the trace: its last collective, whether it waits in it, where its
    main thread was (py-spy), its process state (/proc) and how its process ended (manifest)."""

    rank: int
    last: OpView | None
    group: str | None
    waiting: bool
    stack: str | None
    in_collective: bool | None
    exit_code: int | None
    exit_source: str | None
    process_state: str | None = None  # /proc state at the hang: T, t, D (does not run), R, S...; None: not read


@dataclass(frozen=True, slots=True)
class AlignedRow:
    """One sequence number of the divergent group, each shown rank's op there."""

    seq: int
    cells: dict[int, OpView | None]
    diverging: frozenset[int]  # ranks whose cell differs from the majority at this seq


@dataclass
class Report:
    source: str
    source_kind: str
    verdict: Verdict
    summary: str
    pattern: str | None
    pattern_title: str | None
    culprit_ranks: list[int]
    culprit_reasoning: str
    divergence: Divergence | None
    wait_for: list[WaitEdge]
    cycle: list[WaitEdge] | None
    evidence: list[str]
    candidates: list[Candidate]
    fixes: list[str]
    verify_command: str | None
    suggestion: Suggestion | None
    groups: list[Divergence]
    ranks: list[RankSummary]
    alignment: list[AlignedRow]
    alignment_ranks: list[int]
    incomplete: list[str]
    world_size: int | None
    traced_ranks: list[int]
    collectives: int
    schema_version: int = SCHEMA_VERSION
    #: Completion observed for how many collectives, by source (``moedoctor.analysis.loading.completion``).
    completion: dict | None = None
    #: Why no verify command is offered although a fix is named (the fix cannot reach this code).
    fix_note: str | None = None
    #: The fix's settings derived from this job's code (``{fix name: section}``); ``moedoctor verify
    #: --run`` uses them when no --config is given.
    fix_config: dict | None = None
    #: Storms of small collectives (slow, not stuck: ``moedoctor.analysis.evidence.timing``); None when none.
    slow: SlowReport | None = None
    #: Silences of the collectives that ``moedoctor run`` judged busy (or could not prove a hang),
    #: from the manifest (``moedoctor.rank_states``): the job was not stopped for them.
    busy: list[BusyRecord] = field(default_factory=list)
    #: Level 1: what the traces show happened at the divergence (``analysis.mechanisms``); None
    #: where there is no divergence.
    mechanism: MechanismFinding | None = None
    #: Level 2's gate: per candidate pattern that was not named, what it lacked (its declaration in
    #: ``analysis.patterns``: each pattern's ``DECLARATION``: a mechanism it does not refine, or evidence it requires).
    not_named: dict[str, list[str]] = field(default_factory=dict)

    @property
    def problem_found(self) -> bool:
        return self.verdict not in (Verdict.HEALTHY, Verdict.SLOW, Verdict.INTERRUPTED)
