"""The recorder on real torchrun jobs (Gloo): coverage of every collective path, identical sequences
across ranks, unchanged numerics, records that survive an abort, and the event cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from moedoctor.trace.reader import read_traces
from recorder_checks import (
    MIXED, assert_aborted_rank_kept_its_collective, assert_capped_at, assert_mixed_job_recorded, numbers,
)
from torchrun_util import REPO, assert_ok, job_env, recorded_env, run_command, torchrun_command


def run_mixed(run_dir: Path | None, nproc: int, tmp_path: Path):
    env = recorded_env(run_dir) if run_dir else job_env()
    cmd = torchrun_command(MIXED, nproc, "--steps", "2", "--checkpoint-dir", str(tmp_path / f"ckpt-{nproc}-{bool(run_dir)}"))
    return run_command(cmd, timeout=240, env=env)


@pytest.mark.parametrize("nproc", [2, 4])
def test_mixed_job_is_recorded_completely_and_identically(nproc, tmp_path):
    run_dir = tmp_path / "run"
    result = run_mixed(run_dir, nproc, tmp_path)
    assert_ok(result)
    assert_mixed_job_recorded(read_traces(run_dir / "traces"), nproc, steps=2, reduce_ops_always_known=False)


def test_recording_does_not_change_results(tmp_path):
    plain = run_mixed(None, 2, tmp_path)
    recorded = run_mixed(tmp_path / "run", 2, tmp_path)
    assert_ok(plain)
    assert_ok(recorded)

    assert numbers(plain.output) and numbers(plain.output) == numbers(recorded.output)


def test_aborted_rank_keeps_the_collective_it_died_in(tmp_path):
    run_dir = tmp_path / "run"
    script = REPO / "tests" / "jobs" / "size_mismatch_abort.py"
    result = run_command(torchrun_command(script, 2), timeout=90, env=recorded_env(run_dir))
    assert result.returncode != 0, result.tail()
    assert_aborted_rank_kept_its_collective(run_dir)


def test_event_cap_stops_recording_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    script = REPO / "tests" / "jobs" / "size_mismatch_abort.py"
    env = recorded_env(run_dir, MOEDOCTOR_MAX_EVENTS="2")
    run_command(torchrun_command(script, 2), timeout=90, env=env)
    assert_capped_at(run_dir, 2)
