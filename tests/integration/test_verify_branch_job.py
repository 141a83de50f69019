"""A fix that reaches inline code: the skip decision is an ``if`` in the training loop (no function
to patch). ``moedoctor run`` finds that ``if`` from the ranks' stacks and writes it into the report;
the ``moedoctor verify`` command the report prints, run as printed, makes it collective and passes.
Pointing the fix the wrong way (``agree: all``: skip only when every rank would) leaves rank 1
stepping on its non-finite gradients: no skip happens, and verification fails."""

from __future__ import annotations

import json
import sys

from torchrun_util import REPO, diagnose_and_verify, passed_checks, run_command

JOB = REPO / "tests" / "jobs" / "inline_skip.py"
DECISION = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if line.strip() == "if bad:")


def _moedoctor(*args: str) -> list[str]:
    return [sys.executable, "-m", "moedoctor", *args]


def test_the_printed_verify_command_makes_the_inline_decision_collective(tmp_path):
    run_dir = tmp_path / "run"
    report, result, verified = diagnose_and_verify(run_dir, JOB)
    context = f"{report['summary']}\n{result.tail(20)}"
    assert report["pattern"] == "skipped-optimizer-step" and report["culprit_ranks"] == [1], context
    branch = report["fix_config"]["skip-step-collectively"]["branch"]
    assert (branch["file"], branch["line"], branch["agree"]) == (str(JOB), DECISION, "any"), context
    assert report["verify_command"] == f"moedoctor verify --fix skip-step-collectively --run {run_dir}", context

    checks = passed_checks(run_dir, "skip-step-collectively", verified)
    context = json.dumps(checks, indent=1)
    assert checks["skip-step-collectively applied"]["passed"], context
    assert checks["skip-step-collectively: skipped step is a no-op"]["passed"], context

    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(f"skip-step-collectively:\n  branch: {{file: {JOB}, line: {DECISION}, agree: all}}\n")
    rerun = run_command(_moedoctor("verify", "--fix", "skip-step-collectively", "--run", str(run_dir), "--config",
                                   str(wrong), "--run-dir", str(tmp_path / "wrong-run"), "--json"), 120, cwd=REPO)
    assert rerun.returncode == 1, rerun.tail(30)
