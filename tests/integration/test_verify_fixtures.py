"""``moedoctor verify`` for real: each desync fixture, diagnosed under ``moedoctor run`` (the
session's shared run), is rerun with the fix its ``expected.yaml`` names and must verify; a fix that
does not belong to the job must fail, saying why."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from torchrun_util import FIXTURES, REPO, run_command, torchrun_command

# A job that is slow, not stuck (failure: slow): tests/integration/test_broadcast_storm.py verifies it.
DESYNC_FIXTURES = sorted(p.parent.name for p in FIXTURES.glob("*/expected.yaml")
                         if (yaml.safe_load(p.read_text()) or {}).get("fix")
                         and (yaml.safe_load(p.read_text()) or {}).get("failure") != "slow")


def moedoctor_verify(run_dir, *fixes: str, timeout: float = 120.0):
    cmd = [sys.executable, "-m", "moedoctor", "verify", "--run", str(run_dir), "--hang-timeout", "8",
           *[a for f in fixes for a in ("--fix", f)]]
    return run_command(cmd, timeout, cwd=REPO)


def load_verification(result, run_dir, fixes: str) -> dict:
    path = run_dir / f"verify-{fixes}" / "verification.json"
    assert path.exists(), f"no verification.json (exit {result.returncode}):\n{result.tail()}"
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", DESYNC_FIXTURES)
def test_fix_verifies(name, diagnosed_run):
    expected = yaml.safe_load((FIXTURES / name / "expected.yaml").read_text())
    run_dir, diagnosed = diagnosed_run(name)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["fixes"][0] == expected["fix"], diagnosed.tail()  # the one the verify command runs

    result = moedoctor_verify(run_dir, expected["fix"])
    verification = load_verification(result, run_dir, expected["fix"])
    context = f"{json.dumps(verification['checks'], indent=1)}\n--- log tail ---\n{result.tail(40)}"
    assert result.returncode == 0 and verification["passed"], context
    checks = {c["name"]: c for c in verification["checks"]}
    assert checks["job completes"]["passed"] and checks["identical collective sequences"]["passed"], context
    assert checks[f"{expected['fix']} applied"]["passed"], context
    numerical = [c for n, c in checks.items() if n.startswith(f"{expected['fix']}: ")]
    assert numerical and all(c["passed"] for c in numerical), context
    if expected["fix"] == "expert-dense":  # the check compared the case the fix is for, on every rank
        (dense,) = numerical
        assert "with an idle expert" in dense["after"] and "none with an idle expert" not in dense["after"], context
    # Every fixture completes steps before it hangs: their losses must come back the same.
    assert checks["losses before the hang"]["passed"], context
    assert verification["losses"]["compared"] >= 4, context
    assert "VERIFIED" in result.output, context


def test_wrong_fix_fails_with_the_reason(diagnosed_run):
    run_dir, _ = diagnosed_run("skipped_optimizer_step")
    result = moedoctor_verify(run_dir, "expert-dense")
    verification = load_verification(result, run_dir, "expert-dense")
    context = f"{json.dumps(verification['checks'], indent=1)}\n--- log tail ---\n{result.tail(40)}"
    assert result.returncode == 1 and not verification["passed"], context
    checks = {c["name"]: c for c in verification["checks"]}
    assert not checks["job completes"]["passed"], context
    assert checks["identical collective sequences"]["failed"], context
    assert "did not apply" in checks["expert-dense applied"]["after"], context
    assert "NOT VERIFIED" in result.output and "skipped-optimizer-step" in result.output, context


def test_before_and_after_name_the_rank_that_failed_first(tmp_path):
    """Rank 1 aborts (SIGABRT), torchrun then stops rank 0 (SIGTERM): the verify table says which
    failed first and how, not "a rank exited -15" (NCCL, issue 30)."""
    run_dir = tmp_path / "run"
    job = REPO / "tests" / "jobs" / "abort_then_teardown.py"
    ran = run_command([sys.executable, "-m", "moedoctor", "run", "--no-online", "--run-dir", str(run_dir),
                       "--hang-timeout", "30", "--", *torchrun_command(job, 2)], 120, cwd=REPO)
    assert ran.returncode == 1, ran.tail()
    result = moedoctor_verify(run_dir, "expert-dense")
    completes = {c["name"]: c for c in load_verification(result, run_dir, "expert-dense")["checks"]}["job completes"]
    said = "rank 1 failed first: SIGABRT (exit -6); then rank 0 stopped by the launcher: SIGTERM (exit -15)"
    assert completes["before"] == said and completes["after"].endswith(said), f"{completes}\n{result.tail()}"
