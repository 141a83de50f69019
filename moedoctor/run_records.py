"""The records of a run directory besides the traces, as both the supervisor and the analysis see
them: stack dumps (``stacks/rank-N.json``), the manifest's rank exits and hang record, and which
supervisor locks are held. Torch-free, and below both ``moedoctor.runner`` (which writes these files)
and ``moedoctor.analysis`` (which reads them): the analysis imports nothing of the runner.

``runner.stacks``, ``runner.manifest`` and ``runner.rundir`` re-export these names.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor import layout
from moedoctor.process_state import ProcessState

# ---- stack dumps -------------------------------------------------------------------------------

#: Frames in these folders are the machinery a rank waits in, not the place the job asked it to.
_LIBRARY_MARKERS = ("/torch/", "/site-packages/", "/dist-packages/")
_STDLIB = sysconfig.get_paths()["stdlib"]
#: moedoctor's own frames: this package where it is installed, or (stacks recorded on another
#: machine) a path through a ``moedoctor/`` folder into one of the package's own modules. Not any
#: path with ``/moedoctor/`` in it: a clone of the repository is a folder of that name too, and the
#: fixtures and jobs in it are the job's own code.
_PACKAGE = str(Path(__file__).resolve().parent) + os.sep
_OWN_MODULES = sorted(
    p.stem if p.suffix == ".py" else p.name
    for p in Path(__file__).resolve().parent.iterdir()
    if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()) or p.name == "_bootstrap")
    and p.name != "__init__.py"
)
_OWN_PATH = re.compile(r"/moedoctor/(?:" + "|".join(map(re.escape, _OWN_MODULES)) + r"|__init__|__main__)(?:/|\.py$)")


def is_own_frame(file: str) -> bool:
    """A frame of moedoctor itself (the recorder, a fix, the bootstrap)."""
    return file.startswith(_PACKAGE) or _OWN_PATH.search(file) is not None


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


@dataclass
class StackDump:
    """One rank's dump: the main thread's Python frames (innermost first), or why there are none."""

    rank: int
    pid: int
    path: Path | None = None
    error: str | None = None
    main_thread: tuple[Frame, ...] = ()
    threads: dict[str, tuple[Frame, ...]] = field(default_factory=dict)
    process: ProcessState | None = None  # its /proc state around the dump (None: not recorded)
    write_error: str | None = None  # its file could not be written (disk full): kept in memory only

    @property
    def frozen(self) -> str | None:
        """``T``, ``t`` or ``D`` when every reading of the process's state said it does not run."""
        return None if self.process is None else self.process.frozen

    @property
    def waiting_in(self) -> Frame | None:
        """The innermost frame of the main thread."""
        return self.main_thread[0] if self.main_thread else None

    @property
    def user_frame(self) -> Frame | None:
        """The innermost main-thread frame outside torch, moedoctor and other installed packages."""
        return next((frame for frame in self.main_thread if not is_library_frame(frame)), None)


def is_library_frame(frame: Frame) -> bool:
    """A frame of torch, moedoctor, another installed package or the standard library: the machinery
    a rank waits in, not the job's own code."""
    return any(m in frame.file for m in _LIBRARY_MARKERS) or frame.file.startswith(_STDLIB) or is_own_frame(frame.file)


#: torch.distributed modules whose frames are a rank waiting on its peers: a collective, a Work's
#: wait, a functional collective's wait, FSDP's unshard/reduce waits, a store or rendezvous.
_COMMUNICATION = (
    "/torch/distributed/distributed_c10d.py",
    "/torch/distributed/c10d_logger.py",
    "/torch/distributed/_functional_collectives",
    "/torch/distributed/rendezvous.py",
    "/torch/distributed/elastic/rendezvous/",
    "/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
    "/torch/distributed/algorithms/join.py",
)
#: torch.distributed modules that compute on local data: DTensor's dispatch, sharding propagation
#: and local ops are arithmetic on this rank's shards, not a wait on a peer (a DTensor op that does
#: communicate goes through the functional collectives above).
_COMPUTATION = ("/torch/distributed/tensor/", "/torch/distributed/_tensor/", "/torch/distributed/device_mesh.py")
#: How deep into the main thread's machinery (frames before the job's own code) a wait is looked for.
_WAIT_DEPTH = 12


#: Functions of torch.distributed that only look something up (a rank, a group, a mesh coordinate):
#: DTensor's dispatch calls them for every op; a rank caught in one is computing, not waiting.
_QUERY = re.compile(r"^_?(get|is|has|check|rank_not_in|world|canonicalize|warn|as_|tensor_to|object_to|to_)")


def _waits(frame: Frame) -> bool:
    """A frame of torch.distributed's communication code (a collective, a Work's or a functional
    collective's wait, FSDP's unshard/reduce waits, a store or rendezvous), not a look-up in it."""
    if frame.function == "wait" or frame.function.startswith("wait_"):
        return "/torch/distributed/" in frame.file or "c10d" in frame.file
    return any(m in frame.file for m in _COMMUNICATION) and not _QUERY.match(frame.function)


def is_distributed_frame(frame: Frame) -> bool:
    """A frame inside torch.distributed's communication machinery (collectives, waits, stores,
    process groups), not its local computation (DTensor dispatch, device-mesh look-ups) or a
    look-up function (``get_rank``). Other torch.distributed code counts (the analysis reads the
    top of a stack with it)."""
    file = frame.file
    if not ("/torch/distributed/" in file or "c10d" in file):
        return False
    if _waits(frame):
        return True
    if _QUERY.match(frame.function) or any(m in file for m in _COMPUTATION):
        return False
    return True


def communication_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The frame in which a main thread (innermost first) waits on its peers, or None when it is
    computing or in the job's own code. Only the library frames above the job's innermost frame
    count (a launcher's ``@record`` wrapper far out is not a wait), and in them only positive
    evidence of a wait (``_waits``: a collective, a wait, a store): DTensor's dispatch
    (``torch/distributed/tensor``), a device-mesh or rank look-up and other torch.distributed code
    are not. This is what the supervisor stops a job on, so it claims nothing it does not know."""
    for frame in frames[:_WAIT_DEPTH]:
        if not is_library_frame(frame) or frame.function == "<module>":
            return None  # the job's own code, or a module being imported (its top level runs)
        if _waits(frame):
            return frame
    return None


def read_stack_dump(path: Path) -> StackDump:
    """Parse a ``stacks/rank-N.json`` written by ``runner.stacks.dump_stacks``."""
    return parse_stack_dump(json.loads(Path(path).read_text()), Path(path))


def parse_stack_dump(record: dict, path: Path | None) -> StackDump:
    raw = record.get("process")
    try:
        process = ProcessState.from_dict(raw) if isinstance(raw, dict) else None
    except ValueError:
        process = None  # a damaged state record costs the state, not the stack
    dump = StackDump(
        rank=int(record["rank"]), pid=int(record["pid"]), path=path, error=record.get("error"), process=process
    )
    for thread in record.get("threads") or ():
        frames = tuple(
            Frame(f.get("name", "?"), f.get("filename", "?"), int(f.get("line") or 0))
            for f in thread.get("frames", ())
            if str(f.get("filename", "")).endswith(".py")
        )
        name = thread.get("thread_name") or str(thread.get("os_thread_id"))
        if name in dump.threads:
            name = f"{name} #{thread.get('os_thread_id')}"
        dump.threads[name] = frames
        if thread.get("os_thread_id") == dump.pid or (not dump.main_thread and name == "MainThread"):
            dump.main_thread = frames
    return dump


# ---- the manifest's rank exits and hang record -----------------------------------------------------


@dataclass
class RankExit:
    """How one rank's process ended. ``source`` says how we know: ``torchrun`` (its failure
    report), ``launcher`` (torchrun exited 0, so every rank did), ``stopped`` (moedoctor stopped
    it: no status of its own) or ``unknown``."""

    rank: int
    host: str | None
    pid: int | None
    local_rank: int | None
    exit_code: int | None
    source: str
    #: torchrun named this rank's failure the root cause (its "first observed failure"): it failed
    #: before the launcher stopped the others. False where unknown (older manifests too).
    first_failure: bool = False


@dataclass
class LastCollective:
    group: str
    seq: int
    op: str
    call_site: str | None
    phase: str
    step: int
    completed: bool


@dataclass
class RankAtHang:
    """One rank when the hang was declared: its last collective and where its main thread waits."""

    rank: int
    host: str | None
    pid: int | None
    last: LastCollective | None
    idle_seconds: float | None
    waiting_in: str | None = None
    user_frame: str | None = None
    stack_file: str | None = None
    stack_error: str | None = None


@dataclass
class HangRecord:
    """The diagnosis of a stuck job. ``trigger`` says what declared it: ``hang`` (no progress for
    ``hang_timeout``), ``desync`` (the online detector saw two ranks of a group issue different
    collectives at one seq: ``finding`` in one line, ``detection_latency_s`` from the later of the two
    issue times to the detection) or ``no-trace`` (no rank had a trace after ``hang_timeout``:
    diagnosed from stacks, ``finding`` says why nothing was recorded; the job is not stopped).
    ``lags``: ranks seen falling behind their group by a step."""

    detected_at: float
    host: str
    hang_timeout: float
    idle_seconds: float
    stopped: bool
    ranks: list[RankAtHang] = field(default_factory=list)
    gpu_file: str | None = None
    trigger: str = "hang"
    finding: str | None = None
    detection_latency_s: float | None = None
    lags: list[str] = field(default_factory=list)
    #: Why the silence was a hang (``rank_states.judge``): who waits in what, and why the ranks they
    #: wait for cannot answer (waiting, stopped, dead, or no CPU, no I/O, no new stack); or, for the
    #: ``max-busy`` trigger, what the ranks were doing when the user's limit ran out.
    proof: str | None = None
    #: ``desync``: the mechanism the online detector's first report named from the two collectives it
    #: compared (``runner.online.first_mechanism``); the analysis may read another with the history.
    mechanism: str | None = None


@dataclass
class BusyRecord:
    """A silence of the collectives that was not a hang (``rank_states``): ``kind`` ``busy`` (ranks
    working, the waited-for ones progressing) or ``unproven`` (evidence missing), ``line`` the
    account last seen, ``start`` (Unix time) when the last collective moved, ``seconds`` how long it
    lasted, ``states`` each rank's state then, ``ended`` whether collectives moved again after it."""

    start: float
    seconds: float
    kind: str
    line: str
    states: dict[str, str] = field(default_factory=dict)
    ended: bool = False


def busy_of(raw: object) -> list[BusyRecord]:
    """The manifest's busy records, typed (malformed entries are left out)."""
    out = []
    for item in raw if isinstance(raw, list) else ():
        try:
            out.append(
                BusyRecord(
                    start=float(item["start"]),
                    seconds=float(item["seconds"]),
                    kind=str(item["kind"]),
                    line=str(item["line"])[:2000],
                    states={str(k): str(v) for k, v in dict(item.get("states") or {}).items()},
                    ended=bool(item.get("ended")),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


# ---- supervisor locks --------------------------------------------------------------------------

LOCK_GLOB = layout.LOCK_GLOB
#: Lock files this process holds (path -> descriptor), for its whole life: the kernel drops them at exit.
HELD_LOCKS: dict[str, int] = {}


def lock_holder(fd: int) -> str:
    try:
        words = os.pread(fd, 200, 0).decode(errors="replace").split()
    except OSError:
        words = []
    if len(words) >= 2:
        return f"moedoctor pid {words[0]} on {words[1]}"
    return "another moedoctor"


def held_by_others(path: Path) -> list[str]:
    """Who holds the supervisor locks in ``path`` other than this process (live supervisors)."""
    holders = []
    for lock in sorted(Path(path).glob(LOCK_GLOB)):
        if str(lock) in HELD_LOCKS:
            continue
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            holders.append(lock_holder(fd))
        finally:
            os.close(fd)
    return holders


def supervisor_alive(path: Path) -> bool | None:
    """Whether a supervisor of this host still holds a lock in ``path``: True, False (a manifest left
    ``running`` is then stale), or None when the directory has no lock file (a run before locks)."""
    if not any(Path(path).glob(LOCK_GLOB)):
        return None
    return bool(held_by_others(path)) or any(str(p) in HELD_LOCKS for p in Path(path).glob(LOCK_GLOB))
