"""``checkpoint_recompute_mismatch`` for real on 2 Gloo ranks: the fixture raises ``CheckpointError``
in rank 1's backward by itself and completes with ``--apply-fix``; under ``moedoctor run`` the report
names the pattern from rank 1's recorded exception (the counts, the checkpointed region); a wrong fix
does not verify. (``test_diagnose_fixtures`` and ``test_verify_fixtures`` also run it with the rest:
the expected.yaml fields, and ``verify --fix expert-dense`` passing.)"""

from __future__ import annotations

import json

from test_fixtures_moe import PG_TIMEOUT, assert_all_steps, assert_fails_at_fault
from test_fixtures_moe import test_expected_yaml_line_references as check_line_references
from test_verify_fixtures import load_verification, moedoctor_verify
from torchrun_util import run_fixture

from moedoctor.trace.reader import read_traces

NAME = "checkpoint_recompute_mismatch"


def test_fails_in_backward_without_fix_and_completes_with_it() -> None:
    result = run_fixture(NAME, 2, *PG_TIMEOUT, timeout=60.0)
    assert_fails_at_fault(result)
    assert "CheckpointError" in result.output and "Number of tensors saved during forward: 85" in result.output
    assert_all_steps(run_fixture(NAME, 2, *PG_TIMEOUT, "--apply-fix", timeout=60.0))


def test_expected_yaml_points_at_code() -> None:
    check_line_references(NAME)


def test_report_names_the_exception_the_counts_and_the_region(diagnosed_run) -> None:
    run_dir, result = diagnosed_run(NAME)
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['evidence'], indent=1)}\n{result.tail(30)}"
    assert report["verdict"] == "crashed" and report["pattern"] == "checkpoint-recompute-mismatch", context
    assert report["culprit_ranks"] == [1] and report["summary"].startswith("Crashed: rank 1 died"), context
    evidence = "\n".join(report["evidence"])
    raised = "rank 1 raised torch.utils.checkpoint.CheckpointError at train.py:109 (main) in backward of step 2"
    assert raised in evidence, context
    assert "85 tensors saved in forward, 53 in recompute" in evidence, context
    assert "checkpointed region: CheckpointedDecoderLayer._forward" in evidence, context
    assert "mlp.experts (4 members)" in evidence, context
    assert report["suggestion"]["call_site"].endswith("train.py:72"), context
    (exc,) = next(t for t in read_traces(run_dir / "traces") if t.rank == 1).exceptions
    assert exc.type == "torch.utils.checkpoint.CheckpointError" and exc.phase.value == "backward" and exc.step == 2
    assert exc.frames[-1].file.endswith("torch/utils/checkpoint.py")


def test_a_wrong_fix_does_not_verify(diagnosed_run) -> None:
    # expert-zero-term runs every expert but idle ones on empty inputs: the recompute still saves tensors
    # of other shapes, and CheckpointError is raised again.
    run_dir, _ = diagnosed_run(NAME)
    result = moedoctor_verify(run_dir, "expert-zero-term")
    verification = load_verification(result, run_dir, "expert-zero-term")
    checks = {c["name"]: c for c in verification["checks"]}
    context = f"{json.dumps(checks, indent=1)}\n{result.tail(30)}"
    assert result.returncode == 1 and not verification["passed"], context
    assert not checks["job completes"]["passed"], context
