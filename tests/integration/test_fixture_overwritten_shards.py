"""Silently overwritten experts, for real: the overwritten_shards fixture under ``moedoctor run
--check-params`` completes with its own exit code, and the parameter check names the expert
parameters, the broadcast from rank 0 and its call site; with ``--apply-fix`` it is clean."""

from __future__ import annotations

import json
import sys

import yaml
from test_fixtures_moe import test_expected_yaml_line_references as check_line_references
from torchrun_util import FIXTURES, REPO, run_command, torchrun_command

FIXTURE = FIXTURES / "overwritten_shards"
EXPECTED = yaml.safe_load((FIXTURE / "expected.yaml").read_text())
MOEDOCTOR = [sys.executable, "-m", "moedoctor"]


def test_expected_yaml_points_at_code() -> None:
    check_line_references("overwritten_shards")


def _run(tmp_path, name, *args):
    run_dir = tmp_path / name
    job = torchrun_command(FIXTURE / "train.py", 2, "--pg-timeout", "20", "--steps", "2", *args)
    result = run_command([*MOEDOCTOR, "run", "--run-dir", str(run_dir), "--hang-timeout", "20", "--check-params",
                          "--", *job], 150, cwd=REPO)
    return run_dir, result


def test_overwritten_experts_are_named_with_the_broadcast_and_the_fix_is_clean(tmp_path):
    run_dir, result = _run(tmp_path, "bug")
    context = result.tail(40)
    assert result.returncode == 0, context  # the job's own status: nothing stopped it
    assert "moedoctor: hang" not in result.output and "moedoctor: desync" not in result.output, context
    assert f"overwritten by broadcast from rank 0 on ranks 0,1 at {EXPECTED['call_site']}" in result.output, context
    check = json.loads((run_dir / "params" / "check.json").read_text())
    assert check["pattern"] == EXPECTED["pattern"], check
    assert sorted(f["name"] for f in check["findings"]) == ["moe.w_in", "moe.w_out"], check
    for f in check["findings"]:
        assert f["overwrite"]["src"] == 0 and f["overwrite"]["call_site"] == EXPECTED["call_site"], f

    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "healthy" and report["params"]["pattern"] == EXPECTED["pattern"], report["params"]

    analyzed = run_command([*MOEDOCTOR, "analyze", "--params", str(run_dir)], 60, cwd=REPO)
    assert analyzed.returncode == 1 and "overwritten-shards" in analyzed.output, analyzed.tail()

    fixed_dir, fixed = _run(tmp_path, "fixed", "--apply-fix")
    assert fixed.returncode == 0, fixed.tail(40)
    clean = json.loads((fixed_dir / "params" / "check.json").read_text())
    assert clean["findings"] == [] and clean["pattern"] is None, clean
    assert clean["points"] == ["prepared", "step 1"], clean
