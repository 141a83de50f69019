"""The run directory's layout: the one place the name of every entry of a run directory is spelled.

A run directory (``moedoctor run --run-dir``, ``moedoctor triage``'s folder) holds::

    manifest.json            what was run, where, how it ended, the hang (runner/manifest.py, manifest_format.py)
    manifest.json.lock       the manifest writers' lock
    supervisor-node<R>.lock  held by node R's live supervisor (run_records.py)
    report.json              the analysis (analysis/report_json.py)
    verification.json        moedoctor verify's verdict (render/verification.py)
    fix-config.json          the fixes' config, as the workers read it (fixes/config.py)
    job.log, job-<node>.log  the job's output on the first node, on each node that joined
    traces/                  per-rank traces and status files (trace/format.py names the files)
    stacks/                  per-rank stack dumps at the hang (``rank-N.json``: runner/stacks.py)
    gpu/                     NVML snapshots, ``<host>.json`` (runner/gpu.py)
    control/                 the snapshot request, the recorders' markers (trace/format.py)
    fixes/                   what each fix did in each worker (``<fix>/rank-N.json``: fixes/runtime.py)
    flight_recorder/         Flight Recorder dumps
    params/                  --check-params fingerprints (trace/params_format.py), check.json

A shared leaf (no torch, nothing of moedoctor's): the recorder, the runner, triage, the fixes and the
analysis all take their paths from here. ``tests/unit/test_owners.py`` fails on these names spelled
anywhere else in the package.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_LOCK = MANIFEST + ".lock"
REPORT = "report.json"
VERIFICATION = "verification.json"
FIX_CONFIG = "fix-config.json"
JOB_LOG = "job.log"
NODE_LOGS = "job-*.log"
#: Every log of the job's output: ``job.log`` and ``job-<node>.log``.
JOB_LOGS = "job*.log"
TRACES = "traces"
STACKS = "stacks"
GPU = "gpu"
CONTROL = "control"
FIXES = "fixes"
FLIGHT_RECORDER = "flight_recorder"
PARAMS = "params"
#: In ``control/``: touched by the watchdog, answered by every rank's recorder.
SNAPSHOT = "snapshot"
#: Supervisor locks: ``supervisor-node<R>.lock``, one per node.
LOCK_PREFIX = "supervisor-node"
LOCK_SUFFIX = ".lock"
LOCK_GLOB = LOCK_PREFIX + "*" + LOCK_SUFFIX

#: What ``--force`` clears from a reused run directory; other files of the user's are left alone.
OWN_ENTRIES = (
    TRACES,
    STACKS,
    GPU,
    CONTROL,
    FIXES,
    FLIGHT_RECORDER,
    PARAMS,
    MANIFEST,
    MANIFEST_LOCK,
    JOB_LOG,
    REPORT,
    VERIFICATION,
    FIX_CONFIG,
    NODE_LOGS,
)


def stack_file_name(rank: int) -> str:
    """A rank's stack dump in ``stacks/``."""
    return f"rank-{rank}.json"


def gpu_file_name(host: str) -> str:
    """A host's NVML snapshot in ``gpu/``."""
    return f"{host}.json"


#: In ``params/``: the parameter check's result (``moedoctor run --check-params``).
PARAMS_CHECK = "check.json"

#: Every stack dump in ``stacks/``.
STACK_FILES = "rank-*.json"


def fix_status_name(rank: int) -> str:
    """What a fix did in rank ``rank``, in ``fixes/<fix>/``."""
    return f"rank-{rank}.json"


#: Every rank's status in ``fixes/<fix>/``.
FIX_STATUS_FILES = "rank-*.json"


def node_log_name(node: str) -> str:
    """The job's output on a node that joined the run."""
    return f"job-{node.replace(':', '-')}.log"


def lock_name(node_rank: str) -> str:
    """The lock file of node ``node_rank``'s supervisor."""
    return f"{LOCK_PREFIX}{node_rank}{LOCK_SUFFIX}"


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    @property
    def traces(self) -> Path:
        return self.path / TRACES

    @property
    def stacks(self) -> Path:
        return self.path / STACKS

    def stack_file(self, rank: int) -> Path:
        return self.stacks / stack_file_name(rank)

    @property
    def gpu(self) -> Path:
        return self.path / GPU

    @property
    def control(self) -> Path:
        return self.path / CONTROL

    @property
    def fixes(self) -> Path:
        """What each fix did in each worker (``fixes/<fix>/rank-N.json``)."""
        return self.path / FIXES

    @property
    def flight_recorder(self) -> Path:
        return self.path / FLIGHT_RECORDER

    @property
    def params(self) -> Path:
        return self.path / PARAMS

    def gpu_file(self, host: str) -> Path:
        return self.gpu / gpu_file_name(host)

    @property
    def params_check(self) -> Path:
        return self.params / PARAMS_CHECK

    @property
    def snapshot_request(self) -> Path:
        """Touched by the watchdog; every rank answers a newer mtime with a coverage record."""
        return self.control / SNAPSHOT

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
        return self.path / MANIFEST

    @property
    def report(self) -> Path:
        """The analysis of the run (``moedoctor analyze --json``'s document), written when it ends."""
        return self.path / REPORT

    @property
    def verification(self) -> Path:
        """``moedoctor verify``'s verdict, in the verifying run's directory."""
        return self.path / VERIFICATION

    @property
    def fix_config(self) -> Path:
        """The fixes' config as the workers read it (``MOEDOCTOR_FIX_CONFIG``)."""
        return self.path / FIX_CONFIG

    @property
    def job_log(self) -> Path:
        """The job's output (stdout and stderr) on the first node."""
        return self.path / JOB_LOG

    def node_log(self, node: str) -> Path:
        """The job's output on a node that joined the run."""
        return self.path / node_log_name(node)
