"""Renderers: the JSON schema, the terminal page, the HTML page and the Perfetto trace."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

from analysis_scenarios import SCENARIOS, healthy
from rich.console import Console

from moedoctor.analysis import analyze
from moedoctor.render.html import html_page
from moedoctor.render.json_report import dumps, report_to_dict
from moedoctor.render.perfetto import perfetto_trace
from moedoctor.render.terminal import render_report

TOP_KEYS = {"schema_version", "moedoctor_version", "source", "verdict", "summary", "pattern", "pattern_title",
            "culprit_ranks", "culprit_reasoning", "divergence", "evidence", "fixes", "verify_command", "fix_note",
            "fix_config", "suggestion", "mechanism", "not_named",
            "candidates", "wait_for", "cycle", "groups", "ranks", "incomplete", "completion", "slow", "busy"}
OP_KEYS = {"seq", "op", "shapes", "out_shapes", "dtypes", "reduce_op", "call_site", "function", "phase", "step",
           "module", "peer", "completed", "time"}


def render(report, width=110) -> str:
    out = io.StringIO()
    render_report(report, Console(file=out, width=width, force_terminal=False))
    return out.getvalue()


def test_json_schema():
    doc = json.loads(dumps(analyze(SCENARIOS["skipped-optimizer-step"][0]())))
    assert set(doc) == TOP_KEYS and doc["schema_version"] == 1
    assert doc["verdict"] == "desync" and doc["pattern"] == "skipped-optimizer-step" and doc["culprit_ranks"] == [1]
    div = doc["divergence"]
    assert div["group"] == {"name": "0", "desc": "default_pg", "ranks": [0, 1]} and div["kind"] == "mismatch"
    assert set(div["per_rank"]) == {"0", "1"}
    for op in div["per_rank"].values():
        assert set(op) == OP_KEYS
    assert div["per_rank"]["0"]["call_site"] == "/job/optim.py:45" and div["per_rank"]["1"]["phase"] == "forward"
    assert doc["fixes"] == ["skip-step-collectively"]
    assert doc["verify_command"] == "moedoctor verify --fix skip-step-collectively --run /runs/test"
    assert all(isinstance(e, str) for e in doc["evidence"]) and isinstance(doc["incomplete"], list)


def test_json_missing_rank_is_null():
    doc = report_to_dict(analyze(SCENARIOS["straggler"][0]()))
    assert doc["divergence"]["per_rank"]["1"] is None and doc["divergence"]["missing"] == [1]
    assert doc["wait_for"] == [{"rank": 0, "group": "0", "seq": 3, "op": "all_reduce", "waits_for": [1]}]


def test_terminal_report_has_table_evidence_fix_and_suggestion():
    text = render(analyze(SCENARIOS["skipped-optimizer-step"][0]()))
    assert "moedoctor: DESYNC" in text and "Skipped optimizer step" in text
    assert "rank 1 (culprit)" in text and "▶ 15" in text          # the divergence row, aligned by seq
    assert "optim.py:45" in text and "train.py:69" in text       # call sites in the cells
    assert "Evidence" in text and "non-finite" in text
    assert "moedoctor verify --fix skip-step-collectively --run /runs/test" in text
    assert "Suggestion" in text and "ReduceOp.MAX" in text


def test_terminal_healthy_is_one_panel():
    text = render(analyze(healthy()))
    assert "moedoctor: HEALTHY" in text and "Evidence" not in text


def test_html_is_self_contained():
    page = html_page(analyze(SCENARIOS["straggler"][0]()))
    assert page.startswith("<!DOCTYPE html>") and "ShardReader._read_shard" in page
    assert "<title>moedoctor: STUCK" in page  # inline CSS and JS only: nothing is fetched
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "@import" not in page


def test_perfetto_one_track_per_rank_with_the_divergence_marked():
    run = SCENARIOS["inflight-metric-allreduce"][0]()
    report = analyze(run)
    trace = perfetto_trace(run, report)
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == sum(len(t.events) for t in run.traces)
    marks = [e for e in events if e["ph"] == "i"]
    assert {m["pid"] for m in marks} == {0, 1} and all("DIVERGENCE" in m["name"] for m in marks)
    for pid in (0, 1):  # slices on one track never overlap (Perfetto needs them nested)
        track = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["pid"] == pid and e["tid"] == 1)
        assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in zip(track, track[1:]))
    json.dumps(trace)


def test_analysis_and_renderers_import_no_torch():
    code = ("import sys, moedoctor.analysis, moedoctor.analysis.loading.scan, moedoctor.analysis.patterns as p, "
            "moedoctor.render.terminal, moedoctor.render.json_report, moedoctor.render.html, "
            "moedoctor.render.perfetto; "
            "p.registry(); sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_phase_other_reads_outside_forward_backward_on_screen_and_stays_other_in_json():
    report = analyze(SCENARIOS["inflight-metric-allreduce"][0]())
    metric = [op for op in report.divergence.per_rank.values() if op is not None and op.op == "all_reduce"]
    assert metric and metric[0].phase == "other"
    table = render(report).split("Evidence")[0]
    assert "outside forward/backward s" in table and "other s" not in table
    doc = report_to_dict(report)
    assert "other" in {op["phase"] for op in doc["divergence"]["per_rank"].values() if op}
    assert "outside forward/backward" in html_page(report)
