"""A metric all-reduce in the micro-batch loop meets an FSDP2 all-gather that comes from the first
micro-batch that uses a kept-unsharded unit (tests/jobs/inline_metric_lazy_unit.py: inline code, no
function of the metrics fix's contract). The report offers ``fsdp-gather-upfront`` by structure and
the printed verify command passes as printed; the metrics fix, whose targets this job never ran, is
not offered."""

from __future__ import annotations

import json

from torchrun_util import REPO, diagnose_and_verify, passed_checks

JOB = REPO / "tests" / "jobs" / "inline_metric_lazy_unit.py"


def test_gathering_kept_units_up_front_is_offered_and_verified(tmp_path):
    run_dir = tmp_path / "run"
    report, result, verified = diagnose_and_verify(run_dir, JOB)
    context = f"{report['summary']}\n{result.tail(20)}"
    assert report["pattern"] == "inflight-metric-allreduce" and report["culprit_ranks"] == [1], context
    assert report["fix_config"] == {"fsdp-gather-upfront": {"units": "kept"}}, context
    assert report["verify_command"] == f"moedoctor verify --fix fsdp-gather-upfront --run {run_dir}", context

    checks = passed_checks(run_dir, "fsdp-gather-upfront", verified)
    context = json.dumps(checks, indent=1)
    assert checks["fsdp-gather-upfront: ranks agreed on the units to gather"]["passed"], context
    assert checks["losses before the hang"]["passed"], context
