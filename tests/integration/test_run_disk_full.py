"""``moedoctor run`` with its run directory on a 64 KiB tmpfs that fills up while the job runs
(issue 12), for real on Gloo: the ranks' recorders stop recording and say so once each, the job
runs to completion with its own exit status 0, no hang is declared from the traces' silence (the
job runs on for several hang timeouts after the disk filled), and the run is not called healthy.
Needs root (``mount``); skipped, saying why, where a tmpfs cannot be mounted."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from moedoctor.errors import EXIT_BAD_INPUT
from moedoctor.trace.format import STOPPED, read_statuses
from torchrun_util import REPO, run_command, torchrun_command

JOB = REPO / "tests" / "jobs" / "steady_progress.py"
HANG_TIMEOUT = 2.0


@pytest.fixture
def tiny_fs(tmp_path):
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount permission): {done.stderr.strip()[-300:]}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


@pytest.mark.parametrize("recorder", ["auto", pytest.param("python", marks=pytest.mark.heavy)])
def test_a_full_disk_stops_the_recording_not_the_job(tiny_fs, recorder):
    run_dir = tiny_fs / "run"
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", str(HANG_TIMEOUT),
           "--recorder", recorder, "--", *torchrun_command(JOB, 2, "--steps", "600", "--sleep", "0.01")]
    result = run_command(cmd, timeout=240)
    finished = time.time()
    out = result.output
    assert result.returncode == 0, result.tail()  # the job's own status
    assert "[rank 0] done 600 steps" in out and "[rank 1] done 600 steps" in out, result.tail()
    for rank in (0, 1):
        assert out.count(f"moedoctor: rank {rank} stopped recording: No space left on device (errno 28 ENOSPC") == 1, \
            result.tail()
    assert "Traceback" not in out and "moedoctor: hang" not in out and "stopping the job" not in out, result.tail()
    assert "the recording stopped on ranks 0,1" in out and "Healthy" not in out, result.tail()

    statuses = read_statuses(run_dir / "traces")
    assert {r: s["state"] for r, s in statuses.items()} == {0: STOPPED, 1: STOPPED}
    # The job ran on long enough after the last record that the silence would have been a hang.
    assert finished - max(s["t"] for s in statuses.values()) > 2 * HANG_TIMEOUT, result.tail()
    doc = json.loads((run_dir / "manifest.json").read_text())  # finalized in the manifest's own blocks
    assert doc["status"] == "finished" and doc["hang"] is None
    assert all(r["exit_code"] == 0 for r in doc["ranks"].values())

    analysis = run_command([sys.executable, "-m", "moedoctor", "analyze", str(run_dir)], timeout=120)
    assert analysis.returncode == EXIT_BAD_INPUT, analysis.output[-2000:]
    assert "stopped recording: No space left on device" in analysis.output
