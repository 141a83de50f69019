"""Stacks of the ranks of this node, taken with ``py-spy dump --json`` (all threads, in parallel).

Each rank's dump goes to ``stacks/rank-N.json``::

    {"rank": 0, "pid": 1234, "host": "node1", "time": 1700000000.0, "native": false,
     "threads": [...py-spy's --json output: thread_name, os_thread_id, frames (innermost first)...]}

or, when py-spy could not dump it, the same without ``threads`` and with ``"error": "<why, and
what to do>"``. Either way the record holds the process's state, read from ``/proc`` before py-spy
runs (and once more after it), whatever py-spy does::

    "process": {"state": "T", "samples": "TTTT", "wchan": "do_signal_stop", "seconds": 0.21}

A process that does not run (state ``T``, ``t`` or ``D`` in every reading) is read with
``py-spy dump --nonblocking``, which never attaches: attaching would fail on a stopped process (or
leave it running on detach) and would never return from one in ``D``. ``read_stack_dump`` parses
the record back into a ``StackDump``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moedoctor.errors import cannot_write
from moedoctor.layout import stack_file_name
from moedoctor.run_records import (  # noqa: F401 - the records live below the runner; re-exported here
    Frame,
    StackDump,
    is_library_frame,
    parse_stack_dump,
    read_stack_dump,
)
from moedoctor.runner.procs import FROZEN_STATES, ProcessState, more_readings, process_state

PTRACE_HELP = (
    "py-spy needs ptrace permission to read another process's stack: run moedoctor as "
    "root, or give the container the SYS_PTRACE capability (docker run --cap-add SYS_PTRACE; "
    'Kubernetes: securityContext.capabilities.add: ["SYS_PTRACE"])'
)
_CAP_HELP = (
    "give the container the SYS_PTRACE capability (docker run --cap-add SYS_PTRACE; Kubernetes: "
    'securityContext.capabilities.add: ["SYS_PTRACE"])'
)
#: What py-spy (and the kernel through it) prints when ptrace is refused. Not the bare word
#: "ptrace": py-spy names ptrace events in errors that have nothing to do with permission (a
#: stopped process: "unexpected waitpid result PtraceEvent(...)").
_PERMISSION_HINTS = ("permission denied", "operation not permitted", "eperm")
_CAP_SYS_PTRACE = 19


@dataclass(frozen=True, slots=True)
class StackTarget:
    rank: int
    pid: int
    nonblocking: bool = False  # read without attaching (a stopped or D-state process: attaching would
    #                            wake it or never return); py-spy may then see a torn stack


def find_py_spy() -> str | None:
    """py-spy on PATH, or installed beside this Python."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sysconfig.get_path("scripts")) / "py-spy"
    return str(beside) if beside.is_file() else None


#: Written as the error of every rank when ``moedoctor run --no-stacks`` skipped py-spy.
NOT_TAKEN = "stack not taken (moedoctor run --no-stacks); the process state was recorded"


def dump_stacks(
    targets: list[StackTarget],
    out_dir: Path,
    host: str,
    native: bool = False,
    timeout: float = 30.0,
    py_spy: bool = True,
) -> list[StackDump]:
    """Read every target's process state, then dump its stacks (unless ``py_spy`` is False), in
    parallel, into ``out_dir/rank-N.json``; never raises for a target that cannot be dumped (its
    file and its ``StackDump`` say why)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # each dump says it could not be written
    exe = find_py_spy() if py_spy else None
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(targets)))) as pool:
        return list(pool.map(lambda t: _dump_one(t, out_dir, host, native, timeout, exe, py_spy), targets))


def _dump_one(
    target: StackTarget, out_dir: Path, host: str, native: bool, timeout: float, exe: str | None, py_spy: bool = True
) -> StackDump:
    record = {"rank": target.rank, "pid": target.pid, "host": host, "time": time.time(), "native": native}
    # The state first, from /proc alone: it holds whatever py-spy does next.
    started = time.monotonic()
    state = process_state(target.pid)
    nonblocking = target.nonblocking or state.frozen is not None
    if nonblocking:
        record["nonblocking"] = True
    if not py_spy:
        record["error"] = NOT_TAKEN
    elif exe is None:
        record["error"] = f"py-spy is not installed: {sys.executable} -m pip install py-spy"
    else:
        cmd = (
            [exe, "dump", "--json", "--pid", str(target.pid)]
            + (["--native"] if native else [])
            + (["--nonblocking"] if nonblocking else [])
        )
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if done.returncode == 0:
                record["threads"] = json.loads(done.stdout)
            else:
                record["error"] = _explain(done.stderr or done.stdout, target.pid, state)
        except subprocess.TimeoutExpired:
            record["error"] = f"py-spy dump of pid {target.pid} did not finish in {timeout:.0f} s" + _state_note(state)
        except (OSError, ValueError) as e:
            record["error"] = f"py-spy dump of pid {target.pid} failed: {e}" + _state_note(state)
        state = more_readings(state, target.pid, started)
    record["process"] = state.to_dict()
    path = out_dir / stack_file_name(target.rank)
    try:
        path.write_text(json.dumps(record, indent=1))
    except OSError as e:  # disk full, read-only: the dump is still used, from memory
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        dump = parse_stack_dump(record, None)
        dump.write_error = cannot_write(path, e, "the stack is used from memory")
        return dump
    return parse_stack_dump(record, path)


def _state_note(state: ProcessState | None) -> str:
    frozen = state.frozen if state is not None else None
    return f" (the process is {FROZEN_STATES[frozen]})" if frozen else ""


def ptrace_capable() -> bool | None:
    """Whether this process may ptrace any process (CAP_SYS_PTRACE in its effective set, and no
    Yama scope that forbids all attaching); None when it cannot be told."""
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
        if scope == "3":
            return False
    except OSError:
        pass
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _message(stderr: str) -> str:
    """py-spy's error in one line: its first line and the causes it lists (``Caused by:``)."""
    lines = [line.strip() for line in stderr.strip().splitlines()]
    if not lines:
        return "no output"
    parts = [lines[0].removeprefix("Error: ")]
    if "Caused by:" in lines:
        for line in lines[lines.index("Caused by:") + 1 :]:
            if not line:
                break
            parts.append(line.split(": ", 1)[1] if line[:1].isdigit() and ": " in line else line)
    return ": ".join(parts)


def _explain(stderr: str, pid: int, state: ProcessState | None = None) -> str:
    """Why py-spy failed, in words that are true: a process that does not run is said to be
    stopped (or in ``D``), not unreadable for lack of permission; moedoctor never tells a user to
    run as root when it runs as root."""
    message = _message(stderr)
    frozen = state.frozen if state is not None else None
    if frozen is None:  # it may have stopped since it was read
        now = process_state(pid, readings=1)
        frozen = now.frozen
    if frozen:
        return (
            f"py-spy could not read pid {pid}: the process is {FROZEN_STATES[frozen]}, so it cannot be "
            f"attached to (py-spy: {message})"
        )
    if any(hint in stderr.lower() for hint in _PERMISSION_HINTS):
        capable = ptrace_capable()
        if capable:
            return (
                f"py-spy dump of pid {pid} failed ({message}), although moedoctor may trace any process "
                "(it holds CAP_SYS_PTRACE): the process may be held by another tracer (a debugger), or gone"
            )
        if os.geteuid() == 0:
            return (
                f"py-spy has no permission to attach to pid {pid}: moedoctor runs as root, but without "
                f"CAP_SYS_PTRACE (or kernel.yama.ptrace_scope is 3); {_CAP_HELP}"
            )
        return f"py-spy has no permission to attach to pid {pid}. {PTRACE_HELP}"
    return f"py-spy dump of pid {pid} failed: {message}"
