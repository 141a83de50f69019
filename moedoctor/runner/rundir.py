"""The run directory: the unit of capture (manifest, per-rank traces, stacks, GPU snapshots, the
job's log), and the rules for choosing, reusing and joining one."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from moedoctor.errors import EXIT_USAGE, MoedoctorError
from moedoctor.runner.command import same_job

MANIFEST_NAME = "manifest.json"
#: What ``--force`` clears from a reused run directory; other files of the user's are left alone.
_OWN_ENTRIES = ("traces", "stacks", "gpu", "control", "fixes", "flight_recorder", MANIFEST_NAME,
                MANIFEST_NAME + ".lock", "job.log", "report.json", "verification.json", "fix-config.json", "job-*.log")


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    @property
    def traces(self) -> Path:
        return self.path / "traces"

    @property
    def stacks(self) -> Path:
        return self.path / "stacks"

    @property
    def gpu(self) -> Path:
        return self.path / "gpu"

    @property
    def control(self) -> Path:
        return self.path / "control"

    @property
    def snapshot_request(self) -> Path:
        """Touched by the watchdog; every rank answers a newer mtime with a coverage record."""
        return self.control / "snapshot"

    def request_snapshot(self) -> float:
        """Ask every rank's recorder for a coverage record (they poll the request's mtime; the answer
        also shows that the rank's Python threads still run); returns the request's time. OSError if
        the run directory cannot be written."""
        requested = time.time()
        self.control.mkdir(parents=True, exist_ok=True)
        self.snapshot_request.touch()
        os.utime(self.snapshot_request, (requested, requested))
        return requested

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST_NAME

    @property
    def report(self) -> Path:
        """The analysis of the run (``moedoctor analyze --json``'s document), written when it ends."""
        return self.path / "report.json"

    @property
    def job_log(self) -> Path:
        """The job's output (stdout and stderr) on the first node."""
        return self.path / "job.log"

    def node_log(self, node: str) -> Path:
        """The job's output on a node that joined the run."""
        return self.path / f"job-{node.replace(':', '-')}.log"


def default_run_dir(base: Path, now: datetime | None = None) -> Path:
    """A new timestamped folder under ``base`` (``base/20250101-120000``, ``-2``, ... if taken)."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    candidate, n = base / stamp, 1
    while candidate.exists():
        n += 1
        candidate = base / f"{stamp}-{n}"
    return candidate


def prepare_run_dir(path: Path, command: list[str], force: bool) -> bool:
    """Make ``path`` ready for a run of ``command``; return True when joining a run in progress.

    A run directory whose manifest describes a still-running run of the same job is joined (each
    node of a multi-node job runs the same command against one shared directory). Any other
    non-empty directory is refused unless ``force``, which clears moedoctor's own entries in it.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise MoedoctorError(f"run directory {path} exists and is not a directory", EXIT_USAGE)
    if path.is_dir() and any(path.iterdir()):
        if _running_same_job(RunDir(path), command):
            return True
        if not force:
            raise MoedoctorError(
                f"run directory {path} is not empty: choose another --run-dir, or pass --force to "
                "replace the run recorded there", EXIT_USAGE)
        for pattern in _OWN_ENTRIES:
            for entry in path.glob(pattern):
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return False


def _running_same_job(run_dir: RunDir, command: list[str]) -> bool:
    try:
        manifest = json.loads(run_dir.manifest.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(manifest, dict) and manifest.get("status") == "running"
            and isinstance(manifest.get("command"), list) and same_job(manifest["command"], command))
