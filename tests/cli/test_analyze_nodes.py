"""``moedoctor analyze DIR1 DIR2``: one job's per-node run directories, one report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

from moedoctor.cli.main import app

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from test_analysis_merge import split_by_node  # noqa: E402


def test_analyze_merges_the_nodes_run_dirs(tmp_path):
    node0, node1 = split_by_node(tmp_path)
    result = CliRunner().invoke(app, ["analyze", str(node0), str(node1), "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 1 and report["pattern"] == "inflight-metric-allreduce", result.output[-2000:]
    assert report["culprit_ranks"] == [1] and report["source"]["traced_ranks"] == [0, 1]
    alone = json.loads(CliRunner().invoke(app, ["analyze", str(node0), "--json"]).output)
    assert alone["pattern"] != "inflight-metric-allreduce"  # one node's directory cannot tell


def test_params_takes_one_run_dir(tmp_path):
    node0, node1 = split_by_node(tmp_path)
    result = CliRunner().invoke(app, ["analyze", "--params", str(node0), str(node1)])
    assert result.exit_code != 0
