"""``expert-dense`` and ``expert-zero-term`` injected into real torchrun jobs (Gloo, 2 ranks) by the
bootstrap, without ``--apply-fix``: the inactive-experts fixture, which aborts without a fix, must
complete, with each rank's status showing the fixture block patched, called and checked. On the
fixture whose experts are FSDP2 units of their own, expert-zero-term must refuse, loudly, and change
nothing."""

from __future__ import annotations

import re
from pathlib import Path

from moedoctor.fixes.status import read_fix_status
from torchrun_util import FIXTURES, JobResult, recorded_env, run_command, torchrun_command

TARGET = "_lib.moe:TinyMoeSparseMoeBlock.forward"
STEP_LINE = re.compile(r"\[rank (\d+)\] step (\d+) loss")


def run_with_fix(fixture: str, fix: str, run_dir: Path, *args: str, timeout: float = 120) -> JobResult:
    cmd = torchrun_command(FIXTURES / fixture / "train.py", 2, *args)
    return run_command(cmd, timeout, env=recorded_env(run_dir, MOEDOCTOR_FIXES=fix, MOEDOCTOR_FIX_CHECKS="1"))


def assert_fixed_run(fix: str, check: str, run_dir: Path) -> dict:
    result = run_with_fix("inactive_experts", fix, run_dir, "--steps", "4", "--pg-timeout", "30")
    assert result.returncode == 0, f"{fix}: job failed with {result.returncode}:\n{result.tail()}"
    steps = {(int(r), int(s)) for r, s in STEP_LINE.findall(result.output)}
    assert steps == {(r, s) for r in (0, 1) for s in range(4)}, result.tail()
    assert "routed around experts [3]" in result.output, result.tail()
    status = read_fix_status(run_dir, fix)
    assert not status.problems and sorted(status.ranks) == [0, 1], (status, result.tail())
    checks = {}
    for rank, rank_status in status.ranks.items():
        target = next(t for t in rank_status.targets if t.path == TARGET)
        assert target.patched and target.calls >= 4 * 2 and target.error is None, (rank, target)
        checks[rank] = next(c for c in rank_status.checks if c.name == check)
        assert checks[rank].failures == 0, (rank, checks[rank])
    return checks


def test_expert_dense_completes_the_inactive_experts_job(tmp_path):
    from moedoctor.fixes.expert_dense import CHECK

    checks = assert_fixed_run("expert-dense", CHECK, tmp_path / "run")
    for rank, check in checks.items():
        assert check.passed is True and check.worst is not None and check.worst < 1e-5, (rank, check)
    # 2 layers: their first 2 calls, one token of a checked call (no call had an idle expert yet: forced),
    # then on rank 1 the fault step, where expert 3 got no token
    assert checks[1].runs == 2 * 2 + 1 + 2, checks[1]
    assert ("7 calls compared, 3 with an idle expert (TinyMoeSparseMoeBlock idle expert(s) [3]; forced on one "
            "token of a checked call") in checks[1].detail, checks[1]
    # rank 0 never idles an expert by itself: the forced comparison is its only one with an idle expert
    assert "1 with an idle expert (forced on one token of a checked call" in checks[0].detail, checks[0]


def test_expert_zero_term_completes_the_inactive_experts_job(tmp_path):
    from moedoctor.fixes.expert_zero_term import CHECK

    checks = assert_fixed_run("expert-zero-term", CHECK, tmp_path / "run")
    # Only the fault rank (1) has an idle expert, at step 2: its zero terms are checked bitwise;
    # rank 0 never needs one, so its check says "not checked yet".
    assert checks[1].passed is True and "[3]" in checks[1].detail, checks[1]
    assert checks[0].passed in (True, None), checks[0]


def test_expert_zero_term_refuses_fsdp_expert_units(tmp_path):
    # The refusal comes at the first forward; without the fault (--fault-step -1) the job then runs
    # on, unchanged, instead of hanging until the process-group timeout.
    run_dir = tmp_path / "run"
    result = run_with_fix("inflight_metric_allreduce", "expert-zero-term", run_dir, "--steps", "2",
                          "--fault-step", "-1", "--pg-timeout", "10", timeout=60)
    assert result.returncode == 0, result.tail()
    status = read_fix_status(run_dir, "expert-zero-term")
    notes = status.notes()
    assert any("REFUSED" in n and "FSDP2 unit" in n and "Use expert-dense" in n for n in notes), (notes, result.tail())
    assert "Use expert-dense" in result.output, result.tail()
