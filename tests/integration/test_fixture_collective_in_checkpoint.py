"""``collective_in_checkpointed_region`` for real on 2 Gloo ranks: the fixture hangs in backward by
itself (rank 0's checkpoint recompute re-issues the all_gather of position_ids, rank 1's early-stopped
recompute does not) and completes with ``--apply-fix``; under ``moedoctor run`` the report names the
pattern, the culprit and the call site from the records and the stacks. (``test_diagnose_fixtures``,
``test_verify_fixtures`` and ``test_fixtures_fixed_sequences`` also run it with the rest: the
expected.yaml fields, ``verify --fix recompute-cache-collective`` passing, the fixed run's sequences.)"""

from __future__ import annotations

import json

from test_fixtures_moe import PG_TIMEOUT, assert_all_steps, assert_fails_at_fault
from test_fixtures_moe import test_expected_yaml_line_references as check_line_references
from test_verify_fixtures import load_verification, moedoctor_verify
from torchrun_util import FIXTURES, assert_ok, recorded_env, run_command, run_fixture, torchrun_command

from moedoctor.events import Phase
from moedoctor.trace.reader import read_traces

NAME = "collective_in_checkpointed_region"
SITE = "collective_in_checkpointed_region/train.py:43"


def test_hangs_in_backward_without_fix_and_completes_with_it() -> None:
    result = run_fixture(NAME, 2, *PG_TIMEOUT, timeout=60.0)
    assert_fails_at_fault(result)
    assert "padding only" in result.output and "Timed out" in result.output, result.tail()
    assert_all_steps(run_fixture(NAME, 2, *PG_TIMEOUT, "--apply-fix", timeout=60.0))


def test_expected_yaml_points_at_code() -> None:
    check_line_references(NAME)


def test_fixed_run_issues_the_gather_once_per_step_outside_the_region(tmp_path) -> None:
    run_dir = tmp_path / "run"
    cmd = torchrun_command(FIXTURES / NAME / "train.py", 2, "--apply-fix", "--pg-timeout", "30")
    assert_ok(run_command(cmd, timeout=120, env=recorded_env(run_dir)))
    for trace in read_traces(run_dir / "traces"):
        gathers = [e for e in trace.events if e.op == "all_gather" and e.call_site and e.call_site.where.endswith(
            "collective_in_checkpointed_region/train.py:43")]
        assert [(e.step, e.phase) for e in gathers] == [(s, Phase.FORWARD) for s in range(4)], trace.rank


def test_report_names_the_reissued_call_site(diagnosed_run) -> None:
    run_dir, result = diagnosed_run(NAME)
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['evidence'], indent=1)}\n{result.tail(30)}"
    assert report["verdict"] == "desync" and report["pattern"] == "collective-in-checkpointed-region", context
    assert report["culprit_ranks"] == [1], context
    assert report["suggestion"]["call_site"].endswith(SITE), context
    assert "Hoist this collective out of the activation-checkpointed region" in report["suggestion"]["text"]
    evidence = "\n".join(report["evidence"])
    assert "rank 0 issued all_gather [[1, 8]] from train.py:43 in backward (step 2)" in evidence, context
    assert "rank 0's stack shows torch.utils.checkpoint recomputing" in evidence, context
    assert "reduce_scatter [[2212]] in backward of FSDP unit layers.1" in evidence, context
    assert "in steps 0, 1 every rank issued it in forward" in evidence, context
    # The recompute's collective is recorded in phase backward, from the forward's call site.
    rank0 = next(t for t in read_traces(run_dir / "traces") if t.rank == 0)
    phases = [(e.step, e.phase.value) for e in rank0.events if e.call_site and e.call_site.where.endswith(SITE)]
    assert phases[:8] == [(s, p) for s in (0, 1) for p in ("forward",) * 2 + ("backward",) * 2], phases


def test_a_wrong_fix_does_not_verify(diagnosed_run) -> None:
    # expert-dense (the MoE fix) leaves the all_gather in the checkpointed layer: the rerun still desyncs.
    run_dir, _ = diagnosed_run(NAME)
    result = moedoctor_verify(run_dir, "expert-dense")
    verification = load_verification(result, run_dir, "expert-dense")
    context = f"{json.dumps(verification['checks'], indent=1)}\n--- log tail ---\n{result.tail(40)}"
    assert result.returncode == 1 and not verification["passed"], context
    checks = {c["name"]: c for c in verification["checks"]}
    assert not checks["job completes"]["passed"], context
    assert "NOT VERIFIED" in result.output, context
