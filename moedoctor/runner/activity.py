"""Whether a rank makes progress while the job's collectives are silent, measured from ``/proc`` and
from its stacks, never guessed (``moedoctor.rank_states`` judges the silence from these readings).

Per rank process: its main thread's CPU time (``/proc/PID/task/PID/stat``: the thread that trains;
the recorder's and the backends' own threads poll in the background and are not counted), its main
thread's I/O (``/proc/PID/task/PID/io``: bytes read and written, storage and sockets), and, while a
silence lasts, the distinct stacks py-spy sampled of its main thread (a stack not seen before in
this silence is progress; a loop that polls shows the same few stacks over and over). A rank
progresses when its main thread used at least ``CPU_STEP`` of CPU or moved any byte since the last
point of progress, or showed a new stack. Reading ``/proc`` changes nothing in the rank; the samples
use ``py-spy dump --nonblocking``, which never pauses it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from moedoctor.rank_states import RankEvidence
from moedoctor.run_records import Frame, StackDump, communication_frame, parse_stack_dump

PROC = Path("/proc")
#: CPU seconds of the main thread that count as progress (a thread that wakes to poll a flag uses
#: well under a millisecond a wake-up: minutes of polling stay below this).
CPU_STEP = 0.1
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU seconds of one thread (the main thread by default); None when gone."""
    try:
        text = (PROC / str(pid) / "task" / str(tid or pid) / "stat").read_text()
        fields = text.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


def thread_io(pid: int, tid: int | None = None) -> int | None:
    """Bytes the thread read and wrote (``rchar + wchar``: files, pipes, sockets); None when unreadable."""
    try:
        text = (PROC / str(pid) / "task" / str(tid or pid) / "io").read_text()
    except OSError:
        return None
    values = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(values["rchar"]) + int(values["wchar"])
    except (KeyError, ValueError):
        return None


@dataclass
class _Meter:
    pid: int
    cpu_ref: float
    io_ref: int
    progressed: float  # monotonic time of the last progress
    moved: float  # ... of the last progress other than CPU (bytes moved, a new stack)
    cpu_start: float  # at the start of the current silence (for the account)
    io_start: int
    cpu: float = 0.0
    io: int = 0
    stacks: set[tuple[str, ...]] = field(default_factory=set)
    samples: int = 0  # stack samples taken in this silence
    readable: bool = True


class Activity:
    """Per-rank progress meters, sampled by the watchdog about once a second."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.meters: dict[int, _Meter] = {}

    def sample(self, pids: Mapping[int, int]) -> None:
        """Read every rank's main-thread CPU and I/O (``pids``: rank -> pid of this host)."""
        now = self.clock()
        for rank, pid in pids.items():
            cpu, io = thread_cpu(pid), thread_io(pid)
            m = self.meters.get(rank)
            if m is None or m.pid != pid:
                self.meters[rank] = _Meter(pid, cpu or 0.0, io or 0, now, now, cpu or 0.0, io or 0, cpu or 0.0, io or 0)
                self.meters[rank].readable = cpu is not None
                continue
            m.readable = cpu is not None
            if cpu is None:
                continue
            m.cpu, m.io = cpu, io if io is not None else m.io
            moved = io is not None and io != m.io_ref
            if cpu - m.cpu_ref >= CPU_STEP or moved:
                m.cpu_ref, m.io_ref, m.progressed = cpu, m.io, now
            if moved:
                m.moved = now

    def note_stack(self, rank: int, frames: tuple[Frame, ...]) -> bool:
        """A sampled main-thread stack; a stack not seen before in this silence is progress."""
        m = self.meters.get(rank)
        if m is None or not frames:
            return False
        key = tuple(f"{f.file}:{f.function}:{f.line}" for f in frames)
        m.samples += 1
        if key in m.stacks:
            return False
        first = not m.stacks
        m.stacks.add(key)
        if not first:  # the first sample is where the silence found it, not a move
            m.progressed = m.moved = self.clock()
        return not first

    def stable_stack(self, rank: int) -> bool | None:
        """Whether every stack sampled in this silence was the same (None: fewer than two samples):
        a rank blocked in a wait shows one stack; one that imports or computes shows several."""
        m = self.meters.get(rank)
        if m is None or m.samples < 2:
            return None
        return len(m.stacks) == 1

    def new_silence(self) -> None:
        """Collectives moved again: a later silence is judged on its own samples."""
        for m in self.meters.values():
            m.samples = 0
            m.stacks.clear()
            m.cpu_start, m.io_start = m.cpu, m.io

    def quiet(self, rank: int, cpu: bool = True) -> float | None:
        """Seconds since the rank last progressed (None: never measured, or unreadable). ``cpu=False``:
        CPU time does not count (a thread spinning in a device synchronize burns CPU and does nothing)."""
        m = self.meters.get(rank)
        if m is None or not m.readable:
            return None
        return self.clock() - (m.progressed if cpu else m.moved)

    def evidence(self, rank: int, dump: StackDump | None, **known: Any) -> RankEvidence:
        """A rank's evidence from these meters and its last sampled stack (``dump``): where its main
        thread is, whether it waits in torch.distributed, whether its stack stayed put, its progress;
        ``known``: what the caller read itself (alive, frozen, its pending collective...)."""
        frames = dump.main_thread if dump is not None else ()
        wait = communication_frame(frames) if frames else None
        user = dump.user_frame if dump is not None else None
        cpu, io = self.account(rank)
        return RankEvidence(
            rank,
            stack_wait=wait.function if wait is not None else None,
            stack_read=bool(frames),
            stack_stable=self.stable_stack(rank),
            where=str(user or (frames[0] if frames else "")) or None,
            quiet_s=self.quiet(rank),
            cpu_s=cpu,
            io_bytes=io,
            **known,
        )

    def account(self, rank: int) -> tuple[float, int]:
        """Main-thread CPU seconds and I/O bytes since the current silence began."""
        m = self.meters.get(rank)
        if m is None:
            return 0.0, 0
        return max(0.0, m.cpu - m.cpu_start), max(0, m.io - m.io_start)


#: Native frames of a thread that waits on the device (or on NCCL) while its CPU spins: CUDA's
#: synchronize calls and blocking copies (``tensor.item()``), a Work's wait.
_DEVICE_WAIT = re.compile(
    r"Synchroniz|cuMemcpyDtoH|cudaMemcpy(?!Async)|_local_scalar_dense|WorkNCCL::wait|WorkNCCL::synchronize|"
    r"ncclCommWait|cuStreamQuery|cudaStreamQuery|hipStreamSynchronize|hipDeviceSynchronize"
)


def device_wait(pid: int, py_spy: str | None, timeout: float = 10.0) -> str | None:
    """The native frame in which the process's main thread waits on the GPU (or NCCL) while it may
    spin the CPU, e.g. ``cudaStreamSynchronize``; ``""`` when its native stack shows no such wait
    (it computes); None when py-spy could not read it. ``py-spy dump --native`` pauses the process
    for the few milliseconds of one dump."""
    if py_spy is None:
        return None
    try:
        done = subprocess.run(
            [py_spy, "dump", "--native", "--json", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout
        )
        threads = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    for thread in threads if isinstance(threads, list) else ():
        if thread.get("os_thread_id") != pid and thread.get("thread_name") != "MainThread":
            continue
        for frame in (thread.get("frames") or [])[:40]:
            name = str(frame.get("name") or "")
            if _DEVICE_WAIT.search(name):
                return name
        return ""
    return None


def sample_stacks(pids: Mapping[int, int], py_spy: str | None, timeout: float = 10.0) -> dict[int, StackDump]:
    """Every rank's stacks now, in memory (``py-spy dump --nonblocking --json``: the rank is never
    paused); ranks py-spy could not read are left out."""
    if py_spy is None:
        return {}
    procs = {
        rank: subprocess.Popen(
            [py_spy, "dump", "--json", "--nonblocking", "--pid", str(pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank, pid in pids.items()
    }
    dumps = {}
    deadline = time.monotonic() + timeout
    for rank, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            continue
        if proc.returncode != 0:
            continue
        try:
            dumps[rank] = parse_stack_dump({"rank": rank, "pid": pids[rank], "threads": json.loads(out)}, None)
        except (ValueError, TypeError, KeyError):
            continue
    return dumps
