"""Run real ``torchrun`` jobs from tests, with a hard timeout and the log tail shown on failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"


@dataclass
class JobResult:
    returncode: int
    output: str
    seconds: float

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def torchrun_command(script: str | Path, nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(script), *args]


def diagnose_and_verify(run_dir: Path, script: Path, nproc: int = 2, timeout: float = 150.0
                        ) -> tuple[dict, JobResult, JobResult]:
    """``moedoctor run`` on ``script``, then the verify command its report printed, run as printed:
    ``(report, run result, verify result)``; the verify result's returncode is 2 when none was printed."""
    import shlex

    moedoctor = [sys.executable, "-m", "moedoctor"]
    result = run_command([*moedoctor, "run", "--run-dir", str(run_dir), "--hang-timeout", "10", "--",
                          *torchrun_command(script, nproc)], timeout, cwd=REPO)
    report = json.loads((run_dir / "report.json").read_text())
    if not report.get("verify_command"):
        return report, result, JobResult(2, "no verify command printed", 0.0)
    printed = shlex.split(report["verify_command"])
    return report, result, run_command([*moedoctor, *printed[1:], "--json"], timeout, cwd=REPO)


def passed_checks(run_dir: Path, fix: str, verified: JobResult) -> dict[str, dict]:
    """The checks of ``moedoctor verify --fix FIX``'s ``verification.json`` in ``run_dir``, by name,
    after asserting that the verification passed (the log tail and the checks shown if not)."""
    verification = json.loads((run_dir / f"verify-{fix}" / "verification.json").read_text())
    checks = {c["name"]: c for c in verification["checks"]}
    assert verified.returncode == 0 and verification["passed"], f"{json.dumps(checks, indent=1)}\n{verified.tail(30)}"
    return checks


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> JobResult:
    """Run ``cmd`` to completion; a job still running after ``timeout`` seconds is killed with its
    whole session and reported as return code -9 with whatever it printed."""
    import time

    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or job_env(), cwd=cwd or REPO, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        code = -9
    return JobResult(code, out, time.monotonic() - start)


def _kill_session(pid: int) -> None:
    import signal

    # torchrun starts its workers in sessions of their own: kill every descendant, not just the group.
    victims = [pid, *_descendants(pid)]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def run_fixture(name: str, nproc: int, *args: str, timeout: float = 120.0) -> JobResult:
    return run_command(torchrun_command(FIXTURES / name / "train.py", nproc, *args), timeout)


def assert_ok(result: JobResult) -> None:
    assert result.returncode == 0, f"job failed with {result.returncode}:\n{result.tail()}"


def recorded_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """The environment ``moedoctor run`` gives a job: the bootstrap first on PYTHONPATH."""
    bootstrap = REPO / "moedoctor" / "_bootstrap"
    path = os.pathsep.join(p for p in (str(bootstrap), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return job_env(MOEDOCTOR_RUN_DIR=str(run_dir), PYTHONPATH=path, **extra)


def live_processes(matches) -> list[int]:
    """Pids of live (non-zombie) processes for which ``matches(proc_dir)`` is true."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            alive = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if alive and matches(entry):
                found.append(int(entry.name))
        except OSError:
            continue  # exited while we looked
    return found


#: What moedoctor prints when it raises an alarm (online desync, hang watchdog, the report after).
ALARMS = ("moedoctor: desync", "moedoctor: hang", "Desync detected while the job ran", "No trace after")


def torch_exit_abort(result: JobResult, run_dir: Path) -> bool:
    """The job did its work, then a rank aborted at interpreter exit with "terminate called without
    an active exception": a known PyTorch/Gloo teardown race (Gloo's threads outlive
    ``destroy_process_group`` in DDP jobs), seen under plain ``torchrun`` too, in a few percent of
    runs. No alarm, no hang, no divergence: not moedoctor's doing, so the run is retried once. (The
    recorder's own way to cause it, destroying the Works it held while the interpreter finalized, is
    tested on its own: ``test_native_recorder.py::``
    ``test_works_released_while_the_interpreter_exits_do_not_abort_the_job``.)"""
    if result.returncode == 0 or "terminate called without an active exception" not in result.output:
        return False
    if any(a in line for line in result.output.splitlines() for a in ALARMS):
        return False
    manifest_path = run_dir / "manifest.json"
    return manifest_path.exists() and json.loads(manifest_path.read_text())["hang"] is None
