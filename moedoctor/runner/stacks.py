"""Stacks of the ranks of this node, taken with ``py-spy dump --json`` (all threads, in parallel).

Each rank's dump goes to ``stacks/rank-N.json``::

    {"rank": 0, "pid": 1234, "host": "node1", "time": 1700000000.0, "native": false,
     "threads": [...py-spy's --json output: thread_name, os_thread_id, frames (innermost first)...]}

or, when py-spy could not dump it, the same without ``threads`` and with ``"error": "<why, and
what to do>"``. ``read_stack_dump`` parses either back into a ``StackDump``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

PTRACE_HELP = ("py-spy needs ptrace permission to read another process's stack: run moedoctor as "
               "root, or give the container the SYS_PTRACE capability (docker run --cap-add SYS_PTRACE; "
               "Kubernetes: securityContext.capabilities.add: [\"SYS_PTRACE\"])")
_PERMISSION_HINTS = ("permission denied", "operation not permitted", "ptrace", "eperm")
#: Frames in these folders are the machinery a rank waits in, not the place the job asked it to.
_LIBRARY_MARKERS = ("/torch/", "/moedoctor/", "/site-packages/", "/dist-packages/")
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


@dataclass(frozen=True, slots=True)
class StackTarget:
    rank: int
    pid: int
    nonblocking: bool = False  # read without attaching (a stopped or D-state process: attaching would
    #                            wake it or never return); py-spy may then see a torn stack


@dataclass
class StackDump:
    """One rank's dump: the main thread's Python frames (innermost first), or why there are none."""

    rank: int
    pid: int
    path: Path | None = None
    error: str | None = None
    main_thread: tuple[Frame, ...] = ()
    threads: dict[str, tuple[Frame, ...]] = field(default_factory=dict)

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
    return any(m in frame.file for m in _LIBRARY_MARKERS) or frame.file.startswith(_STDLIB)


def find_py_spy() -> str | None:
    """py-spy on PATH, or installed beside this Python."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sysconfig.get_path("scripts")) / "py-spy"
    return str(beside) if beside.is_file() else None


def dump_stacks(targets: list[StackTarget], out_dir: Path, host: str, native: bool = False,
                timeout: float = 30.0) -> list[StackDump]:
    """Dump every target's stacks in parallel into ``out_dir/rank-N.json``; never raises for a
    target that cannot be dumped (its file and its ``StackDump`` say why)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    py_spy = find_py_spy()
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(targets)))) as pool:
        return list(pool.map(lambda t: _dump_one(t, out_dir, host, native, timeout, py_spy), targets))


def _dump_one(target: StackTarget, out_dir: Path, host: str, native: bool, timeout: float,
              py_spy: str | None) -> StackDump:
    record = {"rank": target.rank, "pid": target.pid, "host": host, "time": time.time(), "native": native}
    if target.nonblocking:
        record["nonblocking"] = True
    if py_spy is None:
        record["error"] = f"py-spy is not installed: {sys.executable} -m pip install py-spy"
    else:
        cmd = [py_spy, "dump", "--json", "--pid", str(target.pid)] + (["--native"] if native else []) \
            + (["--nonblocking"] if target.nonblocking else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if done.returncode == 0:
                record["threads"] = json.loads(done.stdout)
            else:
                record["error"] = _explain(done.stderr or done.stdout, target.pid)
        except subprocess.TimeoutExpired:
            record["error"] = f"py-spy dump of pid {target.pid} did not finish in {timeout:.0f} s"
        except (OSError, ValueError) as e:
            record["error"] = f"py-spy dump of pid {target.pid} failed: {e}"
    path = out_dir / f"rank-{target.rank}.json"
    path.write_text(json.dumps(record, indent=1))
    return _parse(record, path)


def _explain(stderr: str, pid: int) -> str:
    message = stderr.strip().splitlines()[0] if stderr.strip() else "no output"
    if any(hint in stderr.lower() for hint in _PERMISSION_HINTS):
        return f"py-spy has no permission to attach to pid {pid}. {PTRACE_HELP}"
    return f"py-spy dump of pid {pid} failed: {message}"


def read_stack_dump(path: Path) -> StackDump:
    """Parse a ``stacks/rank-N.json`` written by ``dump_stacks``."""
    return _parse(json.loads(Path(path).read_text()), Path(path))


def _parse(record: dict, path: Path) -> StackDump:
    dump = StackDump(rank=int(record["rank"]), pid=int(record["pid"]), path=path, error=record.get("error"))
    for thread in record.get("threads") or ():
        frames = tuple(Frame(f.get("name", "?"), f.get("filename", "?"), int(f.get("line") or 0))
                       for f in thread.get("frames", ()) if str(f.get("filename", "")).endswith(".py"))
        name = thread.get("thread_name") or str(thread.get("os_thread_id"))
        if name in dump.threads:
            name = f"{name} #{thread.get('os_thread_id')}"
        dump.threads[name] = frames
        if thread.get("os_thread_id") == dump.pid or (not dump.main_thread and name == "MainThread"):
            dump.main_thread = frames
    return dump
