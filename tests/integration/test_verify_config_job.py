"""``--config`` names the user's own function (a ``__main__`` target), and the skip check is not a
formality: a "skip" that steps with zeroed gradients (AdamW weight decay still moves the weights,
seed 001) fails verification."""

from __future__ import annotations

import json
import sys

import pytest
from torchrun_util import REPO, run_command, torchrun_command

JOB = REPO / "tests" / "jobs" / "skip_then_step.py"


@pytest.mark.parametrize("skip", ["clean", "wrong", "reset"])
def test_skip_check_catches_a_step_that_is_not_a_no_op(tmp_path, skip):
    """``wrong``: the skip path steps with zeroed gradients (fails); ``reset``: it copies saved weights
    back without a step, the job's own way of skipping (passes, and says it)."""
    config = tmp_path / "fixes.yaml"
    config.write_text("skip-step-collectively:\n  decision: __main__:should_skip\n")
    rerun = tmp_path / "rerun"
    job = torchrun_command(JOB, 2, *([] if skip == "clean" else [f"--{skip}-skip"]))
    result = run_command([sys.executable, "-m", "moedoctor", "verify", "--fix", "skip-step-collectively",
                          "--config", str(config), "--run-dir", str(rerun), "--hang-timeout", "20", "--json",
                          "--", *job], 120, cwd=REPO)
    assert (rerun / "verification.json").exists(), result.tail()
    verification = json.loads((rerun / "verification.json").read_text())
    checks = {c["name"]: c for c in verification["checks"]}
    context = f"{json.dumps(checks, indent=1)}\n{result.tail(30)}"
    assert checks["skip-step-collectively applied"]["passed"], context
    no_op = checks["skip-step-collectively: skipped step is a no-op"]
    if skip == "wrong":
        assert result.returncode == 1 and no_op["passed"] is False, context
        assert "AdamW.step() ran during the skip" in no_op["after"], context
    elif skip == "reset":
        assert result.returncode == 0 and no_op["passed"] is True, context
        assert "changed" in no_op["after"] and "without a step" in no_op["after"], context
    else:
        assert result.returncode == 0 and no_op["passed"] is True, context
        assert "bitwise unchanged" in no_op["after"], context
