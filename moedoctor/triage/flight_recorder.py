"""Ask a running job's ranks for a Flight Recorder dump through PyTorch's debug pipe.

With ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=PREFIX`` (``TORCH_FR_DEBUG_INFO_PIPE_FILE`` in newer torch)
in its environment, each NCCL process group creates the named pipe ``PREFIX<rank>.pipe`` and its
heartbeat monitor polls it about once a second; anything written there makes it write its Flight
Recorder buffer to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` (``TORCH_FR_DUMP_TEMP_FILE``; default
``/tmp/nccl_trace_rank_<rank>``). The job goes on running. Only ``ProcessGroupNCCL`` (and XCCL) has
that pipe: a Gloo job has no trigger from outside in torch 2.13.

The pipe is opened with ``O_NONBLOCK``: when no process reads it (the rank is gone, or it is not
an NCCL job) the open fails at once (``ENXIO``) instead of blocking.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.runner import procs

PIPE_VARIABLES = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE")
DUMP_VARIABLES = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"


@dataclass
class FlightRecorderResult:
    dumps: dict[int, Path] = field(default_factory=dict)  # rank -> the copy in the triage folder
    notes: list[str] = field(default_factory=list)
    enabled: bool = False


def pipe_prefix(env: dict[str, str]) -> str | None:
    return next((env[v] for v in PIPE_VARIABLES if env.get(v)), None)


def dump_prefix(env: dict[str, str]) -> str:
    return next((env[v] for v in DUMP_VARIABLES if env.get(v)), DEFAULT_DUMP_PREFIX)


def trigger_dumps(
    ranks: dict[int, tuple[int, dict[str, str]]], out_dir: Path, wait: float = 5.0, poll: float = 0.2
) -> FlightRecorderResult:
    """Write to the debug pipe of each rank (``rank -> (pid, environ)``) that has one, and copy the
    dumps that appear within ``wait`` seconds into ``out_dir/fr_rank_<rank>``."""
    result = FlightRecorderResult()
    pending: dict[int, tuple[Path, float]] = {}
    for rank, (pid, env) in sorted(ranks.items()):
        prefix = pipe_prefix(env)
        if prefix is None:
            continue
        result.enabled = True
        pipe = procs.path_of(pid, f"{prefix}{rank}.pipe")
        target = procs.path_of(pid, f"{dump_prefix(env)}{rank}")
        before = _mtime(target)
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            why = {
                errno.ENOENT: "does not exist (not an NCCL process group yet, or TORCH_FR_BUFFER_SIZE=0)",
                errno.ENXIO: "has no reader (the rank's NCCL heartbeat monitor is not running)",
            }
            result.notes.append(f"rank {rank}: Flight Recorder pipe {pipe} {why.get(e.errno, str(e))}")
            continue
        try:
            os.write(fd, b"1")
        except OSError as e:
            result.notes.append(f"rank {rank}: could not write to {pipe}: {e}")
            continue
        finally:
            os.close(fd)
        pending[rank] = (target, before)
    if not pending:
        return result
    deadline = time.monotonic() + wait
    while pending and time.monotonic() < deadline:
        time.sleep(poll)
        for rank, (target, before) in list(pending.items()):
            mtime = _mtime(target)
            if mtime > before and time.time() - mtime > poll:  # written, and not still being written
                out_dir.mkdir(parents=True, exist_ok=True)
                copy = out_dir / f"fr_rank_{rank}"
                shutil.copyfile(target, copy)
                result.dumps[rank] = copy
                del pending[rank]
    for rank, (target, _) in sorted(pending.items()):
        result.notes.append(f"rank {rank}: no Flight Recorder dump appeared at {target} within {wait:.0f} s")
    return result


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
