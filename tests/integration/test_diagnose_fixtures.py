"""End to end: every fixture under ``moedoctor run`` for real (Gloo, 2 ranks), then the report.

``RUN_DIR/report.json`` must name what the fixture's ``expected.yaml`` says: the pattern, the
culprit ranks, the group's ranks and the call site (in the divergence, the evidence or the
suggestion). The controls come out ``healthy``, ``straggler`` and ``rank-stopped``.
``inactive_experts`` aborts on Gloo (the size mismatch raises SIGABRT) instead of hanging, so its
verdict is ``crashed`` with the desync pattern still named, unless online detection stopped the job
as a desync first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from torchrun_util import FIXTURES

from moedoctor.errors import EXIT_HANG

# The healthy corpus (healthy_*) has its own test, with its rank counts and environments.
# A job that is slow, not stuck (failure: slow) completes: tests/integration/test_broadcast_storm.py runs it.
# One that completes with wrong weights (failure: silent): tests/integration/test_fixture_overwritten_shards.py.
NAMES = sorted(
    p.parent.name
    for p in FIXTURES.glob("*/expected.yaml")
    if not p.parent.name.startswith("healthy_")
    and "failure: slow" not in p.read_text()
    and "failure: silent" not in p.read_text()
)


def call_sites(report: dict) -> list[str]:
    sites = []
    div = report["divergence"]
    if div:
        sites += [op["call_site"] for op in div["per_rank"].values() if op and op["call_site"]]
    if report["suggestion"] and report["suggestion"]["call_site"]:
        sites.append(report["suggestion"]["call_site"])
    return sites


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_diagnosed(name, diagnosed_run):
    expected = yaml.safe_load((FIXTURES / name / "expected.yaml").read_text())
    run_dir, result = diagnosed_run(name)
    report_path = run_dir / "report.json"
    assert report_path.exists(), f"no report.json (exit {result.returncode}):\n{result.tail()}"
    report = json.loads(report_path.read_text())
    context = f"{report['summary']}\n{json.dumps(report['candidates'], indent=1)}\n--- log tail ---\n{result.tail(40)}"

    if expected["pattern"] is None:
        assert report["verdict"] == expected.get("verdict", "healthy"), context
        assert result.returncode == 0, context
        return
    assert report["pattern"] == expected["pattern"], context
    assert report["culprit_ranks"] == expected["culprit_ranks"], context
    assert report["divergence"]["group"]["ranks"] == expected["group_ranks"], context
    if expected.get("call_site"):
        sites = call_sites(report)
        assert any(s.endswith(expected["call_site"]) for s in sites) or \
            any(expected["call_site"] in e for e in report["evidence"]), (sites, context)
    if expected.get("fix"):
        assert report["fixes"][0] == expected["fix"], context  # the one the verify command runs
        assert f"moedoctor verify --fix {expected['fix']} --run" in result.output, context
    if expected.get("failure") == "abort":
        # Gloo's size check aborts a rank within milliseconds; online detection sees the mismatched
        # pair first in most runs and stops the job as a desync. Either way the pattern is named.
        assert report["verdict"] in ("crashed", "desync"), context
        if report["verdict"] == "desync":
            assert result.returncode == EXIT_HANG, context
    else:
        assert result.returncode == EXIT_HANG, context
        stuck = expected["pattern"] in ("straggler", "not-a-desync", "rank-stopped")
        assert report["verdict"] == ("stuck" if stuck else "desync"), context
        if not stuck:
            check_flight_recorder_agrees(run_dir, report)


def check_flight_recorder_agrees(run_dir: Path, report: dict) -> None:
    """At the hang the recorder also wrote PyTorch's own Flight Recorder dump of every rank: read on
    its own, it must reach the same divergence, and say what it cannot know."""
    from moedoctor.analysis import analyze, load_run
    from moedoctor.render.json_report import report_to_dict

    folder = run_dir / "flight_recorder"
    assert sorted(p.name for p in folder.iterdir()) == ["fr_rank_0", "fr_rank_1"]
    fr = report_to_dict(analyze(load_run(folder)))
    assert fr["verdict"] == "desync", fr["summary"]
    assert fr["divergence"]["group"]["ranks"] == report["divergence"]["group"]["ranks"], fr["summary"]
    assert fr["divergence"]["seq"] == report["divergence"]["seq"], (fr["summary"], report["summary"])
    assert any("Flight Recorder records none of them" in note for note in fr["incomplete"]), fr["incomplete"]
    # Without phases or evidence the pattern is not claimed; the moedoctor trace's pattern is
    # among the candidates or the analysis says it cannot tell.
    assert fr["pattern"] in ("unknown-desync", report["pattern"]), fr["summary"]
