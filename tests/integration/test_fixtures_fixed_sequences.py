"""With its fix, every fixture completes with identical collective sequences on every rank:
recorded for real (Gloo, 2 ranks) and compared group by group, with the recorder's coverage check
against the backends' own counters."""

from __future__ import annotations

import pytest
import yaml

from moedoctor.trace.reader import read_traces
from torchrun_util import FIXTURES, assert_ok, recorded_env, run_command, torchrun_command

FIXED = sorted(p.parent.name for p in FIXTURES.glob("*/expected.yaml")
               if yaml.safe_load(p.read_text()).get("fix"))


@pytest.mark.parametrize("name", FIXED)
def test_fixed_fixture_has_identical_sequences(name, tmp_path):
    run_dir = tmp_path / "run"
    cmd = torchrun_command(FIXTURES / name / "train.py", 2, "--apply-fix", "--pg-timeout", "30")
    result = run_command(cmd, timeout=120, env=recorded_env(run_dir))
    assert_ok(result)
    traces = read_traces(run_dir / "traces")
    assert [t.rank for t in traces] == [0, 1]
    sequences: dict[str, dict[int, list]] = {}
    for trace in traces:
        assert trace.coverage and trace.coverage[-1].complete, f"rank {trace.rank}: {trace.coverage}"
        for event in trace.events:
            if not event.is_p2p:
                sequences.setdefault(event.group.name, {}).setdefault(trace.rank, []).append(event.signature())
    assert sequences, "no collective recorded"
    for group, by_rank in sequences.items():
        members = next(t.groups[group].ranks for t in traces if group in t.groups)
        assert all(by_rank.get(r) == by_rank[members[0]] for r in members), \
            f"{name}: group {group} differs across ranks: {[len(by_rank.get(r, [])) for r in members]}"
