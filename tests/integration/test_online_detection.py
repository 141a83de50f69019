"""End to end: ``moedoctor run`` detects desyncs online, long before ``--hang-timeout`` (Gloo).

Every desync fixture runs with ``--hang-timeout 120`` and a 60 s process-group timeout: the run must
be diagnosed by the online detector (the manifest's hang ``trigger`` is ``desync``) within a loose
10 s of the mismatched collective (``benchmarks/online_detection.py`` measures it precisely), end far
before 120 s, and its report must still name the fixture's pattern. ``inactive_experts`` aborts on Gloo
at the mismatched reduce-scatter: either the detector sees both sides first, or the run ends as a
crash with the pattern named. A 4-rank job with several groups desyncs on one pair's group; a long
healthy job (tens of thousands of collectives, async ops, p2p, several groups) raises no alarm.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from torchrun_util import FIXTURES, REPO, run_command, torchrun_command

from moedoctor.errors import EXIT_HANG

JOBS = REPO / "tests" / "jobs"
DESYNC_FIXTURES = ["inactive_experts", "inflight_metric_allreduce", "skipped_optimizer_step",
                   "uneven_dtensor_allgather"]
HANG_TIMEOUT = 120


def moedoctor_run(run_dir: Path, script: Path, nproc: int, *args: str, timeout: float = 150.0):
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", str(HANG_TIMEOUT),
           "--", *torchrun_command(script, nproc, *args)]
    return run_command(cmd, timeout, cwd=REPO)


def manifest_of(run_dir: Path, result) -> dict:
    path = run_dir / "manifest.json"
    assert path.exists(), f"no manifest (exit {result.returncode}):\n{result.tail()}"
    return json.loads(path.read_text())


def assert_online(manifest: dict, result) -> dict:
    hang = manifest.get("hang")
    context = f"exit {result.returncode} after {result.seconds:.1f}s\n--- log tail ---\n{result.tail(40)}"
    assert hang is not None and hang["trigger"] == "desync", context
    assert result.returncode == EXIT_HANG, context
    assert hang["detection_latency_s"] is not None and hang["detection_latency_s"] < 10, (hang, context)
    assert result.seconds < HANG_TIMEOUT / 2, context
    assert "Desync detected while the job ran" in result.output, context
    return hang


@pytest.mark.parametrize("name", DESYNC_FIXTURES)
def test_fixture_desync_detected_online(name, tmp_path):
    expected = yaml.safe_load((FIXTURES / name / "expected.yaml").read_text())
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, FIXTURES / name / "train.py", expected["nproc"], "--pg-timeout", "60")
    manifest = manifest_of(run_dir, result)
    report_path = run_dir / "report.json"
    assert report_path.exists(), f"no report.json (exit {result.returncode}):\n{result.tail()}"
    report = json.loads(report_path.read_text())
    context = f"{report['summary']}\n--- log tail ---\n{result.tail(40)}"
    if expected.get("failure") == "abort" and (manifest.get("hang") or {}).get("trigger") != "desync":
        # Gloo aborted the job before the detector's next poll: diagnosed as a crash, as without it.
        assert report["verdict"] == "crashed", context
        assert result.seconds < HANG_TIMEOUT / 2, context
    else:
        hang = assert_online(manifest, result)
        assert hang["finding"] and f"#{report['divergence']['seq']}," in hang["finding"], (hang, context)
    assert report["pattern"] == expected["pattern"], context
    assert report["culprit_ranks"] == expected["culprit_ranks"], context
    assert report["divergence"]["group"]["ranks"] == expected["group_ranks"], context


def test_subgroup_desync_in_a_four_rank_job(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, JOBS / "online_subgroups.py", 4, "--desync-step", "12", "--pg-timeout", "60")
    hang = assert_online(manifest_of(run_dir, result), result)
    # Rank 3's pair group (2, 3): two collectives a step, so step 12's all_reduce is #25.
    assert hang["finding"].startswith("group 2 "), hang
    assert "#25, rank 2 all_reduce vs rank 3 all_gather" in hang["finding"], hang
    report = json.loads((run_dir / "report.json").read_text())
    assert report["divergence"]["group"]["ranks"] == [2, 3], report["summary"]


def test_long_healthy_run_raises_no_alarm(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, JOBS / "online_long_healthy.py", 2, "--steps", "4000", timeout=240)
    manifest = manifest_of(run_dir, result)
    context = f"exit {result.returncode} after {result.seconds:.1f}s\n--- log tail ---\n{result.tail(40)}"
    assert result.returncode == 0, context
    assert manifest["hang"] is None, (manifest["hang"], context)
    assert "Desync" not in result.output and "moedoctor: desync" not in result.output, context
    assert result.output.count("healthy: 4000 steps") == 2, context
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "healthy", report["summary"]
