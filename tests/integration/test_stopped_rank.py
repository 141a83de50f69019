"""A rank that SIGSTOPs itself mid-training under ``moedoctor run`` (Gloo, 4 ranks): the others wait in
the next all-reduce for a process that does not run. The report must name that rank as stopped
(``rank-stopped``, from its /proc state), suggest no code change, never blame permissions for the
stack it read without attaching, and the whole job must be stopped, the stopped rank included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torchrun_util import REPO, live_processes, run_command, torchrun_command

from moedoctor.errors import EXIT_HANG

JOB = REPO / "tests" / "jobs" / "self_stop.py"
NPROC = 4


def survivors(run_dir: Path) -> list[int]:
    mark = f"MOEDOCTOR_RUN_DIR={run_dir.resolve()}".encode()
    return live_processes(lambda proc: mark in (proc / "environ").read_bytes().split(b"\0"))


def test_a_rank_that_stops_itself_is_reported_stopped_not_a_desync(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "8", "--",
           *torchrun_command(JOB, NPROC)]
    result = run_command(cmd, timeout=150)
    assert result.returncode == EXIT_HANG, result.tail()
    assert not survivors(run_dir), f"processes of the job survived:\n{result.tail()}"
    assert "stopping myself" in (run_dir / "job.log").read_text()

    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['candidates'], indent=1)}\n{result.tail(80)}"
    assert report["verdict"] == "stuck" and report["pattern"] == "rank-stopped", context
    assert report["culprit_ranks"] == [1], context
    assert report["ranks"]["1"]["process_state"] == "T", report["ranks"]
    # The waiting ranks sleep or run: one letter when every reading agreed, else the readings ("SSSR").
    assert all(set(report["ranks"][str(r)]["process_state"]) <= {"S", "R"} for r in (0, 2, 3)), report["ranks"]
    assert "rank 1's process is stopped (state T" in report["summary"], context
    assert any(e.startswith("rank 1's process is stopped (state T") for e in report["evidence"]), context
    # no code fix, no desync, no permission story
    assert report["fixes"] == [] and report["verify_command"] is None
    assert report["suggestion"]["call_site"] is None and "kill -CONT" in report["suggestion"]["text"]
    assert "unknown-desync" not in result.output and "unconditional" not in result.output, context
    assert "permission" not in result.output.lower(), context
    assert "as root" not in result.output, context

    # the stopped rank's stack was read without attaching, and it stayed stopped while read
    dump = json.loads((run_dir / "stacks" / "rank-1.json").read_text())
    assert dump.get("error") is None and dump["nonblocking"] is True, dump.get("error")
    assert set(dump["process"]["samples"]) == {"T"} and len(dump["process"]["samples"]) >= 2, dump["process"]
    for rank in (0, 2, 3):
        other = json.loads((run_dir / "stacks" / f"rank-{rank}.json").read_text())
        assert other.get("error") is None and "nonblocking" not in other, other.get("error")
