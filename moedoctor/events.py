"""The typed records shared by the recorder, the trace reader and the analyzer.

A trace is a sequence of these records per rank. The recorder writes them (through
``moedoctor.trace.format``), the reader yields them, the analyzer consumes them. Nothing here
imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(str, Enum):
    """Where in a training step a collective was issued."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_LOAD = "checkpoint_load"
    OTHER = "other"


#: Normalized collective names: the vocabulary the analyzer compares across ranks.
COLLECTIVE_OPS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "barrier",
        "all_to_all",
        "gather",
        "scatter",
        "reduce",
        "all_reduce_coalesced",
        "all_gather_coalesced",
        "reduce_scatter_coalesced",
        "monitored_barrier",
    }
)
P2P_OPS = frozenset({"send", "recv"})
#: Variable-size collectives: their sizes are checked pairwise (``analysis.contracts``), not compared.
CONTRACT_OPS = frozenset({"all_to_all", "gather", "scatter"})


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """First record of every per-rank trace file."""

    format: str
    version: int
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    torch_version: str
    moedoctor_version: str
    start_time: float
    #: The recording kernel when the trace was opened (``python``, ``native``); None in older traces.
    kernel: str | None = None


@dataclass(frozen=True, slots=True)
class Group:
    """A process group as seen by one rank. ``name`` agrees across ranks; ``ranks`` are global."""

    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CallSite:
    """The first frame outside torch and moedoctor, plus a short bounded stack (innermost first)."""

    file: str
    line: int
    function: str
    stack: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """``file:line`` with the full path: how ``OpView.call_site`` and the analysis name a call site."""
        return f"{self.file}:{self.line}"

    @property
    def short(self) -> str:
        """``file:line`` with the file's base name, as reports show it."""
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.function}"


@dataclass(frozen=True, slots=True)
class CollectiveEvent:
    """One collective (or p2p op) issued by one rank.

    ``seq`` counts collectives per group on this rank, starting at 1; p2p ops do not advance it
    and carry ``peer`` and ``p2p_seq`` (counted per group and peer pair) instead.
    """

    rank: int
    event_id: int
    time: float
    group: Group
    seq: int
    op: str
    raw_op: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    reduce_op: str | None
    async_op: bool
    thread: str
    call_site: CallSite | None
    phase: Phase
    step: int
    module: str | None = None
    peer: int | None = None
    p2p_seq: int | None = None
    completed: float | None = None
    root: int | None = None  # rooted ops: the root's global rank
    in_splits: tuple[int, ...] | None = None  # all_to_all_single: rows sent to each group member
    out_splits: tuple[int, ...] | None = None  # all_to_all_single: rows received from each member
    device: str | None = None  # the first input tensor's device: "cpu", "cuda:0"

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_OPS

    def signature(self) -> tuple:
        """What must agree across the ranks of a group at one sequence number.

        Only what every rank must pass identically: variable-size collectives are compared on what
        must agree, and their sizes by the pairwise contract (``analysis.contracts``). An
        ``all_to_all`` compares the trailing dimensions of its rows (expert-parallel dispatch sends
        data-dependent row counts); a list ``all_gather`` its output list (its inputs may be
        uneven); ``gather`` and ``scatter`` their root (the root's lists pair with the others'
        tensors); other rooted ops their root too. The reduce op is not part of it: a c10d
        collective's reduce op is known only when the recorder saw it still running (see
        ``reduce_ops_agree``)."""
        op = self.op
        if op == "all_to_all":
            return (op, self.dtypes, _rows(self.in_shapes), _rows(self.out_shapes))
        if op == "gather":
            return (op, self.root, self.dtypes)
        if op == "scatter":  # non-root ranks pass no inputs, so no dtypes either
            return (op, self.root)
        if op == "all_gather" and len(self.out_shapes) > 1:
            return (op, self.out_shapes, self.dtypes)
        if self.root is not None:
            return (op, self.in_shapes, self.dtypes, self.root)
        return (op, self.in_shapes, self.dtypes)

    def reduce_ops_agree(self, other: "CollectiveEvent") -> bool:
        return self.reduce_op is None or other.reduce_op is None or self.reduce_op == other.reduce_op


def _rows(shapes: tuple[tuple[int, ...], ...]) -> tuple:
    """What must agree of an all_to_all's tensors: one tensor's trailing dimensions (its rows are
    split across the group), or, for a list of tensors, how many there are."""
    if len(shapes) == 1:
        return ("rows", shapes[0][1:])
    return ("list", len(shapes))


@dataclass(frozen=True, slots=True)
class Evidence:
    """A fact other than a collective that the analysis uses: a gradient norm, parameters without
    gradients, the start or end of backward / optimizer step / checkpoint save or load."""

    rank: int
    time: float
    kind: str
    step: int
    data: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TracebackFrame:
    """One frame of a recorded traceback."""

    file: str
    line: int
    function: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def short(self) -> str:
        """``train.py:109`` (the file's name only)."""
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


@dataclass(frozen=True, slots=True)
class CheckpointedFunction:
    """What ``torch.utils.checkpoint`` was running when an exception passed through it: the
    checkpointed function (``Class.method`` or a function's qualified name), where it is defined,
    the class of the module it belongs to (empty when it is no module's) and that module's lists of
    same-class members."""

    function: str
    file: str
    line: int
    module: str = ""
    #: ``name:count`` of each ``nn.ModuleList`` in the module whose members (2 or more) share one
    #: class: experts run per routed member.
    module_lists: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


@dataclass(frozen=True, slots=True)
class RankException:
    """An exception that nothing caught in one rank (``sys.excepthook`` / ``threading.excepthook``):
    its class with its module (``torch.utils.checkpoint.CheckpointError``), its message (bounded), the
    traceback's frames outermost first (bounded: ``frames_left_out`` middle frames were left out),
    the thread, and the phase and step the rank was in."""

    rank: int
    time: float
    type: str
    message: str
    frames: tuple[TracebackFrame, ...]
    thread: str
    phase: Phase
    step: int
    frames_left_out: int = 0
    checkpointed: CheckpointedFunction | None = None

    @property
    def name(self) -> str:
        """The class's own name (``CheckpointError``)."""
        return self.type.rpartition(".")[2]

    def user_frame(self, library_markers: tuple[str, ...]) -> TracebackFrame | None:
        """The innermost frame whose file has none of ``library_markers`` in its path (None: none)."""
        return next((f for f in reversed(self.frames) if not any(m in f.file for m in library_markers)), None)

    def passes_through(self, path_suffix: str, functions: frozenset[str] | None = None) -> list[TracebackFrame]:
        """The frames in a file ending with ``path_suffix`` (and, given ``functions``, of those names)."""
        return [
            f
            for f in self.frames
            if f.file.replace("\\", "/").endswith(path_suffix) and (functions is None or f.function in functions)
        ]


@dataclass(frozen=True, slots=True)
class GroupCoverage:
    """Recorded collectives of one group against the backend's own sequence counter."""

    group: str
    recorded: int
    backend: int | None

    @property
    def gap(self) -> int | None:
        return None if self.backend is None else self.backend - self.recorded


@dataclass(frozen=True, slots=True)
class Coverage:
    rank: int
    time: float
    reason: str
    groups: tuple[GroupCoverage, ...]
    dropped: int = 0
    #: The kernel whose counters gave ``recorded`` (``python``, ``native``); None in older traces.
    kernel: str | None = None

    @property
    def complete(self) -> bool:
        return self.dropped == 0 and all(g.gap in (0, None) for g in self.groups)
