"""``moedoctor analyze`` on the golden corpus: traces recorded once from every fixture with
``moedoctor run`` (Gloo, 2 ranks) and the report each must give (``expected_report.json``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moedoctor.cli.main import app, main

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "expected_report.json").exists())
runner = CliRunner()


def expected(name: str) -> dict:
    return json.loads((GOLDEN / name / "expected_report.json").read_text())


def call_sites(doc: dict) -> list[str]:
    div = doc["divergence"] or {"per_rank": {}}
    sites = [op["call_site"] for op in div["per_rank"].values() if op and op["call_site"]]
    return sites + [s for s in [doc["suggestion"] and doc["suggestion"]["call_site"]] if s]


@pytest.mark.parametrize("name", CASES)
def test_golden_json_report(name, tmp_path):
    run_dir = tmp_path / name
    shutil.copytree(GOLDEN / name, run_dir)
    result = runner.invoke(app, ["analyze", str(run_dir), "--json"])
    want = expected(name)
    assert result.exit_code == (0 if want["verdict"] == "healthy" else 1), result.output
    doc = json.loads(result.output)
    assert doc["schema_version"] == 1
    for key in ("verdict", "pattern", "culprit_ranks", "fixes"):
        assert doc[key] == want[key], (key, doc["summary"])
    if want["divergence"] is None:
        assert doc["divergence"] is None
    else:
        div = doc["divergence"]
        assert div["kind"] == want["divergence"]["kind"] and div["seq"] == want["divergence"]["seq"]
        assert {"name": div["group"]["name"], "ranks": div["group"]["ranks"]} == want["divergence"]["group"]
        assert {r: (op["op"] if op else None) for r, op in div["per_rank"].items()} == want["divergence"]["ops"]
    if want["call_site"]:
        assert any(s.endswith(want["call_site"]) for s in call_sites(doc)), call_sites(doc)
    if want["fixes"]:
        assert doc["verify_command"] == f"moedoctor verify --fix {want['fixes'][0]} --run {run_dir}"


@pytest.mark.parametrize("name", ["skipped_optimizer_step", "straggler", "healthy"])
def test_golden_terminal_report(name):
    result = runner.invoke(app, ["analyze", str(GOLDEN / name)], terminal_width=120)
    want = expected(name)
    assert f"moedoctor: {want['verdict'].upper()}" in result.output
    if want["pattern"]:
        assert want["pattern"] in result.output
    if want["fixes"]:
        assert f"moedoctor verify --fix {want['fixes'][0]}" in result.output


def test_perfetto_and_html_files(tmp_path):
    perfetto, html = tmp_path / "trace.json", tmp_path / "report.html"
    result = runner.invoke(app, ["analyze", str(GOLDEN / "inflight_metric_allreduce"), "--perfetto", str(perfetto),
                                 "--html", str(html)])
    assert result.exit_code == 1
    trace = json.loads(perfetto.read_text())
    assert any(e["ph"] == "i" and "DIVERGENCE" in e["name"] for e in trace["traceEvents"])
    assert "inflight-metric-allreduce" in html.read_text()


def test_a_folder_of_traces_alone(tmp_path):
    shutil.copytree(GOLDEN / "skipped_optimizer_step" / "traces", tmp_path / "traces")
    result = runner.invoke(app, ["analyze", str(tmp_path / "traces"), "--json"])
    doc = json.loads(result.output)
    assert result.exit_code == 1 and doc["pattern"] == "skipped-optimizer-step" and doc["culprit_ranks"] == [1]
    assert doc["source"]["kind"] == "traces"


@pytest.mark.parametrize("args", [["/nonexistent/run"], ["{empty}"]])
def test_bad_input_exits_2(args, tmp_path, capsys):
    args = [a.replace("{empty}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as e:
        main(["analyze", *args])
    assert e.value.code == 2
    assert "moedoctor:" in capsys.readouterr().err


def test_help_documents_exit_statuses():
    result = runner.invoke(app, ["analyze", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for text in ("--json", "--perfetto", "--html", "Exit status: 0 healthy", "3 an internal error"):
        assert text in result.output
