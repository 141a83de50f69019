"""End to end: the online detector's first report carries the two levels of the final one.

``moedoctor run`` on the in-flight metric fixture (Gloo): the console line printed when the desync
is detected, before the stacks, names the mechanism the two collectives show and no pattern (two
collectives at one position are no pattern's evidence: it says what is missing); the final report
names the pattern, and where its mechanism, read with the ranks' history, differs from the first
report's, it says so.
"""

from __future__ import annotations

import json
import re

import yaml
from test_online_detection import HANG_TIMEOUT, manifest_of, moedoctor_run
from torchrun_util import FIXTURES

from moedoctor.errors import EXIT_HANG


def test_the_first_report_names_the_mechanism_and_no_pattern_yet(tmp_path):
    name = "inflight_metric_allreduce"
    expected = yaml.safe_load((FIXTURES / name / "expected.yaml").read_text())
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, FIXTURES / name / "train.py", expected["nproc"], "--pg-timeout", "60")
    tail = f"exit {result.returncode} after {result.seconds:.1f}s\n--- log tail ---\n{result.tail(40)}"
    assert result.returncode == EXIT_HANG and result.seconds < HANG_TIMEOUT / 2, tail
    hang = manifest_of(run_dir, result)["hang"]
    assert hang["trigger"] == "desync", tail
    first = next((line for line in result.output.splitlines() if line.startswith("moedoctor: desync: group")), None)
    assert first is not None, tail
    named = re.search(r"\(mechanism ([a-z-]+); pattern not named yet: it needs ([^)]*)\)", first)
    assert named is not None, (first, tail)
    assert named.group(1) == hang["mechanism"] == "different-op", (first, hang, tail)
    assert expected["pattern"] not in first, (first, tail)
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{tail}"
    assert report["pattern"] == expected["pattern"], context
    final = report["mechanism"]["mechanism"]
    said = f"read with the ranks' history it is {final}"
    assert (said in " ".join(result.output.split())) == (final != hang["mechanism"]), context
