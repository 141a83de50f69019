"""``moedoctor run`` under faults (issue 12), for real on Gloo: a job that never started is reported
as such; a run directory belongs to one job (a second run on it is refused, naming the pid, and
the first run's traces are untouched); ``kill -9`` of moedoctor stops the job (PR_SET_PDEATHSIG on
the launcher) and leaves a stale manifest that is not joined. On failure the log tails are shown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchrun_util import REPO, job_env, live_processes, run_command, torchrun_command

from moedoctor.errors import EXIT_USAGE

JOBS = REPO / "tests" / "jobs"


def run_cmd(run_dir: Path, script: str | Path, *options: str, script_args: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), *options, "--",
            *torchrun_command(script, 2, *script_args)]


def survivors(run_dir: Path) -> list[int]:
    mark = f"MOEDOCTOR_RUN_DIR={run_dir.resolve()}".encode()
    return live_processes(lambda proc: mark in (proc / "environ").read_bytes().split(b"\0"))


def start(run_dir: Path, out: Path, *options: str) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen(run_cmd(run_dir, JOBS / "quiet_sleep.py", "--hang-timeout", "600", *options),
                                stdout=f, stderr=subprocess.STDOUT, env=job_env(), cwd=REPO, start_new_session=True)


def wait_until(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail}")


def both_sleeping(run_dir: Path) -> bool:
    log = run_dir / "job.log"
    return log.exists() and log.read_text().count("sleeping") >= 2


def cleanup(proc: subprocess.Popen, run_dir: Path) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    for pid in survivors(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_job_that_never_started_is_reported_as_such(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "fails_at_once.py"
    script.write_text("raise SystemExit('cannot read the config')\n")  # fails before any process group
    result = run_command(run_cmd(run_dir, script), timeout=60)
    assert result.returncode not in (0, 124), result.tail()
    assert result.seconds < 45, result.tail()
    assert "the job never started" in result.output, result.tail()
    assert "Healthy" not in result.output, result.tail()
    assert not survivors(run_dir)


def test_a_missing_script_is_refused_before_anything_starts(tmp_path):
    """Issue 32, point 4: one line naming the file, no torchrun traceback, no run directory."""
    run_dir = tmp_path / "run"
    result = run_command(run_cmd(run_dir, tmp_path / "missing.py"), timeout=60)
    assert result.returncode == EXIT_USAGE, result.tail()
    assert f"{tmp_path / 'missing.py'}: no such file (nothing was started)" in result.output, result.tail()
    assert "Traceback" not in result.output and not run_dir.exists(), result.tail()


def test_a_second_run_on_the_same_dir_is_refused(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "first.out"
    first = start(run_dir, out)
    try:
        wait_until(lambda: both_sleeping(run_dir), 90, "both ranks to sleep", out)
        traces = {p.name: (p.stat().st_ino, p.read_bytes()) for p in (run_dir / "traces").glob("rank-*.jsonl")}
        assert len(traces) == 2
        second = run_command(run_cmd(run_dir, JOBS / "quiet_sleep.py", "--hang-timeout", "600"), timeout=30)
        assert second.returncode == EXIT_USAGE, second.tail()
        assert f"pid {first.pid}" in second.output and "live run" in second.output, second.tail()
        forced = run_command(run_cmd(run_dir, JOBS / "quiet_sleep.py", "--force"), timeout=30)
        assert forced.returncode == EXIT_USAGE, forced.tail()
        after = {p.name: (p.stat().st_ino, p.read_bytes()) for p in (run_dir / "traces").glob("rank-*.jsonl")}
        assert sorted(after) == sorted(traces)
        for name, (inode, data) in after.items():
            # Nothing truncated or replaced; the first job's own recorder may still have appended
            # (completions it saw late), but no second job: one header, no event id twice.
            assert inode == traces[name][0] and data.startswith(traces[name][1]), name
            assert data.count(b'"format":"moedoctor-trace"') == 1, name
            ids = [json.loads(line)["i"] for line in data.splitlines() if line.startswith(b'{"k":"c"')]
            assert len(ids) == len(set(ids)), name
        assert first.poll() is None, out.read_text()[-3000:]
    finally:
        cleanup(first, run_dir)
    assert not survivors(run_dir)


def test_kill_9_of_moedoctor_stops_the_job_and_leaves_a_stale_run(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "first.out"
    first = start(run_dir, out)
    try:
        wait_until(lambda: both_sleeping(run_dir), 90, "both ranks to sleep", out)
        assert survivors(run_dir)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        wait_until(lambda: not survivors(run_dir), 15, "the job to stop after kill -9 of moedoctor", out)
    finally:
        cleanup(first, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "running"  # written by the supervisor that was killed
    again = run_command(run_cmd(run_dir, JOBS / "quiet_sleep.py"), timeout=30)
    assert again.returncode == EXIT_USAGE, again.tail()
    assert "no supervisor holds it" in again.output and "--force" in again.output, again.tail()
