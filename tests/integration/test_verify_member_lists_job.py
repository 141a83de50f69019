"""Inactive experts in MoE code moedoctor has no class for (tests/jobs/inline_moe.py: an inline
sparse loop, each expert its own FSDP2 unit): the report offers ``expert-zero-term`` in its
structural mode, and the printed verify command passes as printed. ``expert-dense``, which patches
known block classes only, does not apply to this job and fails."""

from __future__ import annotations

import json
import sys

from torchrun_util import REPO, diagnose_and_verify, passed_checks, run_command

JOB = REPO / "tests" / "jobs" / "inline_moe.py"


def _moedoctor(*args: str) -> list[str]:
    return [sys.executable, "-m", "moedoctor", *args]


def test_the_structural_zero_term_fix_is_offered_and_verified(tmp_path):
    run_dir = tmp_path / "run"
    report, result, verified = diagnose_and_verify(run_dir, JOB)
    context = f"{report['summary']}\n{result.tail(20)}"
    assert report["pattern"] == "inactive-experts" and report["culprit_ranks"] == [1], context
    assert report["fix_config"] == {"expert-zero-term": {"lists": "auto"}}, context
    assert report["verify_command"] == f"moedoctor verify --fix expert-zero-term --run {run_dir}", context

    checks = passed_checks(run_dir, "expert-zero-term", verified)
    context = json.dumps(checks, indent=1)
    assert checks["expert-zero-term: members run once per forward, in index order"]["passed"], context

    wrong = run_command(_moedoctor("verify", "--fix", "expert-dense", "--run", str(run_dir), "--run-dir",
                                   str(tmp_path / "wrong"), "--hang-timeout", "10", "--json"), 150, cwd=REPO)
    assert wrong.returncode == 1, wrong.tail(30)
