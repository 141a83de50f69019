"""``moedoctor triage``'s refusals: each says what is wrong and exits 2; nothing is signalled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moedoctor.cli.main import app

REPO = Path(__file__).resolve().parent.parent.parent


def triage(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moedoctor", "triage", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})


def unused_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_no_such_process(tmp_path):
    pid = unused_pid()
    done = triage("--pid", str(pid), cwd=tmp_path)
    assert done.returncode == 2
    assert f"no such process: {pid}" in done.stderr
    assert not (tmp_path / "moedoctor-triage").exists()


def test_not_a_torch_job(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        done = triage("--pid", str(sleeper.pid), cwd=tmp_path)
        assert done.returncode == 2
        assert "is not a torch distributed job: no process with RANK in its environment under it" in done.stderr
        assert "sleep 30" in done.stderr
        time.sleep(0.1)
        assert sleeper.poll() is None  # left running
    finally:
        sleeper.kill()
        sleeper.wait()


def test_out_dir_not_empty_is_refused(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"], env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    try:
        done = triage("--pid", str(sleeper.pid), "--out", str(tmp_path / "out"), cwd=tmp_path)
        assert done.returncode == 2 and "is not empty: choose another --out" in done.stderr
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_usage_error_without_pid():
    result = CliRunner().invoke(app, ["triage"])
    assert result.exit_code == 2


def test_help_explains():
    result = CliRunner().invoke(app, ["triage", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in ("--pid", "--json", "--native", "--no-flight-recorder", "--out", "never kills", "SYS_PTRACE"):
        assert word in result.output


def test_no_permission_to_read_stacks_says_how_to_fix(tmp_path):
    """py-spy refused (as without SYS_PTRACE in a container): a py-spy on PATH that fails like the real one.
    As root, moedoctor runs without CAP_SYS_PTRACE (setpriv), so that the message is true: it must
    name the capability, and never tell root to run as root."""
    fake = tmp_path / "bin" / "py-spy"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Error: Failed to attach: Operation not permitted (os error 1)' >&2\nexit 1\n")
    fake.chmod(0o755)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop CAP_SYS_PTRACE")
        prefix = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"]
    rank = subprocess.Popen(["sleep", "30"], env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    try:
        done = subprocess.run([*prefix, sys.executable, "-m", "moedoctor", "triage", "--pid", str(rank.pid)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300",
                                   "PATH": f"{fake.parent}:{os.environ['PATH']}"})
        assert done.returncode == 2, done.stdout + done.stderr
        assert "could not read any rank's stack" in done.stderr
        assert "SYS_PTRACE" in done.stderr and "root" in done.stderr
        if os.geteuid() == 0:
            assert "run moedoctor as root" not in done.stderr and "runs as root, but without" in done.stderr
        assert rank.poll() is None
    finally:
        rank.kill()
        rank.wait()
