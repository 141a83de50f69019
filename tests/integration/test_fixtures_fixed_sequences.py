"""With its fix, every fixture completes with identical collective sequences on every rank:
recorded for real (Gloo, 2 ranks) and compared group by group, with the recorder's coverage check
against the backends' own counters."""

from __future__ import annotations

import pytest
import yaml

from moedoctor.trace.reader import read_traces
from recorder_checks import assert_complete_coverage, assert_sequences_identical
from torchrun_util import FIXTURES, assert_ok, recorded_env, run_command, torchrun_command

FIXED = sorted(p.parent.name for p in FIXTURES.glob("*/expected.yaml")
               if yaml.safe_load(p.read_text()).get("fix"))


# broadcast_storm's fixed run is 30 s of a 2-core CI machine: heavy (its fix is verified, sequences
# included, by test_broadcast_storm.py).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n == "broadcast_storm" else n
                                  for n in FIXED])
def test_fixed_fixture_has_identical_sequences(name, tmp_path):
    run_dir = tmp_path / "run"
    cmd = torchrun_command(FIXTURES / name / "train.py", 2, "--apply-fix", "--pg-timeout", "30")
    result = run_command(cmd, timeout=120, env=recorded_env(run_dir))
    assert_ok(result)
    traces = read_traces(run_dir / "traces")
    assert [t.rank for t in traces] == [0, 1]
    assert_complete_coverage(traces)
    assert_sequences_identical(traces)
