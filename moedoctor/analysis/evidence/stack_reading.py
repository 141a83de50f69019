"""One rank's py-spy stack read for the analysis: the collective its main thread waits in, the
API the job called, its innermost own frame, and a normalized key to group identical stacks.

Shared by ``from_stacks`` (triage from stacks alone) and the patterns that read stacks
(``not_a_desync``); it imports no pattern, so neither import loops back through the other.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moedoctor.run_records import Frame, StackDump, is_distributed_frame, is_library_frame

_C10D = "/torch/distributed/distributed_c10d.py"
#: Wrappers between the API the job called and the collective's implementation.
_WRAPPERS = ("/torch/distributed/c10d_logger.py", "/torch/utils/_contextlib.py")


@dataclass(frozen=True, slots=True)
class RankStack:
    """What one rank's main thread shows."""

    rank: int
    collective: str | None  # the innermost torch.distributed function it waits in (None: outside any)
    api: str | None  # the outermost distributed_c10d function of that chain (what the job called)
    user_frame: Frame | None
    key: tuple[str, ...]  # the normalized stack, for grouping

    @property
    def waits_in(self) -> str | None:
        if self.collective is None:
            return None
        return self.collective if self.api in (None, self.collective) else f"{self.api} -> {self.collective}"

    def where(self) -> str:
        f = self.user_frame
        return "no frame of the job's own code" if f is None else str(f)


def read_rank_stack(dump: StackDump) -> RankStack | None:
    """The collective, own frame and normalized stack of a dump (None: no main-thread frames)."""
    frames = dump.main_thread
    if not frames:
        return None
    collective, api = _collective(frames)
    if collective is None and _engine_wait(frames) and dump.process is not None and set(dump.process.samples) == {"S"}:
        collective = _ENGINE_WAIT
    return RankStack(dump.rank, collective, api, user_frame=dump.user_frame, key=_key(frames))


#: torch machinery that runs collectives from C++ with no torch.distributed Python frame on the stack:
#: the autograd engine (DDP's reducer all-reduces gradient buckets from its hooks and waits for them
#: at the end of backward) and DDP's forward (its buffer broadcasts and bucket rebuild).
_ENGINE_FILES = ("/torch/autograd/graph.py", "/torch/nn/parallel/distributed.py")
_ENGINE_WAIT = "a collective torch runs from C++ (DDP's gradient or buffer sync; the process sleeps)"


def _engine_wait(frames: tuple[Frame, ...]) -> bool:
    """The innermost library frames (before the job's own code) include the autograd engine or DDP's
    forward: a rank that sleeps there (every reading of its process state ``S``) waits in a
    collective torch issued from C++, it is not working in its own code."""
    for f in frames:
        if not is_library_frame(f):
            return False
        if any(f.file.endswith(e) for e in _ENGINE_FILES):
            return True
    return False


def _collective(frames: tuple[Frame, ...]) -> tuple[str | None, str | None]:
    """Walk out from the innermost frame through library frames: the innermost torch.distributed
    frame met before the job's own code is the collective; the outermost distributed_c10d frame of
    that run is the API the job called."""
    collective = api = None
    for f in frames:
        if not is_library_frame(f):
            break
        if not is_distributed_frame(f) or any(f.file.endswith(w) for w in _WRAPPERS):
            continue
        if collective is None:
            collective = f.function
        if f.file.endswith(_C10D):
            api = f.function
    return collective, api


def _key(frames: tuple[Frame, ...]) -> tuple[str, ...]:
    return tuple(f"{f.file}:{f.function}" if is_library_frame(f) else f"{f.file}:{f.function}:{f.line}" for f in frames)
