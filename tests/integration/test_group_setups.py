"""Every way a job creates its process groups is recorded (``init_device_mesh`` alone, the function
imported by name, an explicit store, ``new_subgroups`` / ``new_group``), and a job that hangs
before any process group exists is diagnosed from its stacks soon after ``--hang-timeout``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torchrun_util import REPO, JobResult, run_command, torchrun_command

from moedoctor.errors import EXIT_HANG
from moedoctor.trace.reader import read_traces
from recorder_checks import assert_complete_coverage

JOBS = REPO / "tests" / "jobs"


def moedoctor_run(run_dir: Path, script: str, *args: str, options: tuple[str, ...] = ("--hang-timeout", "10"),
                  timeout: float = 120.0) -> JobResult:
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), *options, "--",
           *torchrun_command(JOBS / script, 2, *args)]
    return run_command(cmd, timeout)


@pytest.mark.parametrize("setup", ["mesh", "store"])  # store: an explicit TCPStore, then new_subgroups / new_group
def test_every_group_setup_is_recorded(setup, tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "group_setups.py", "--setup", setup)
    assert result.returncode == 0, result.tail()
    traces = read_traces(run_dir / "traces")
    assert [t.rank for t in traces] == [0, 1], result.tail()
    assert_complete_coverage(traces)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "healthy", report["summary"]


def test_desync_in_a_mesh_only_job_is_diagnosed(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "group_setups.py", "--setup", "mesh", "--desync")
    assert result.returncode == EXIT_HANG, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "desync", report["summary"]
    div = report["divergence"]
    assert div["seq"] == 5 and div["group"]["ranks"] == [0, 1], report["summary"]
    assert div["per_rank"]["0"]["op"] == "all_reduce" and div["per_rank"]["1"]["op"] == "barrier", div
    # Rank 1 leaves the loop body early under a test on the rank: an omission, named with its culprit.
    assert report["pattern"] == "rank-conditional-collective", report["summary"]
    assert report["culprit_ranks"] == [1], report["summary"]


def test_hang_before_any_process_group_is_diagnosed_from_stacks(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "stuck_before_init.py",
                           options=("--hang-timeout", "6", "--startup-timeout", "30"), timeout=150)
    out = result.output
    assert "No trace after" in out and "the recorder is loaded in rank(s) 0,1" in out, result.tail()
    # Reported from the stacks while the job still ran, before the startup timeout stopped it.
    first = out.index("No trace after")
    assert first < out.index("Hang: no rank made progress"), out
    early = out[first:out.index("Hang: no rank made progress")]
    assert "Straggler" in early and "load_dataset_index" in early and "Culprit: rank 1" in early, early
    assert result.returncode == EXIT_HANG, result.tail()
