"""What the analysis says after a fault (issue 33), on built traces: an interrupted run is not a desync,
a rank killed from outside leads the headline, a stopped rank's peers wait where their traces say.
The same faults on real Gloo runs: tests/integration/test_fault_record.py."""

from __future__ import annotations

import dataclasses

from event_factory import manifest, ranks, run_of, stack

from moedoctor.analysis import Verdict, analyze


def _loop(steps: int, ahead: int = 0, gap: float = 0.0):
    """Two ranks in a loop of all_gather + all_reduce; rank 0 ``ahead`` collectives further (not
    completed), issued ``gap`` seconds after rank 1's last."""
    a, b = ranks(2)
    for _ in range(steps):
        for r in (a, b):
            r.coll("all_gather", (4,), line=24)
            r.coll("all_reduce", (4,), line=26, reduce_op="sum")
    a.time += gap
    ops = [("all_gather", 24), ("all_reduce", 26)]
    for i in range(ahead):
        op, line = ops[i % 2]
        a.coll(op, (4,), line=line, done=i < ahead - 1, reduce_op="sum" if op == "all_reduce" else None)
    return a, b


def _killed_supervisor(info):
    return dataclasses.replace(info, status="running", lost_supervisors=["moedoctor pid 4242 on host"],
                               stopped_at=1000.0)


def test_kill_9_of_the_supervisor_with_ragged_ends_is_interrupted_not_a_desync():
    a, b = _loop(100, ahead=1)
    report = analyze(run_of(a, b, manifest_info=_killed_supervisor(manifest(exits={}, hang=False))))
    assert report.verdict == Verdict.INTERRUPTED and report.pattern is None, report.summary
    assert report.divergence is None and report.culprit_ranks == [], report.summary
    assert "its supervisor (moedoctor pid 4242 on host) died at about" in report.summary
    assert "the job was stopped with it" in report.summary and "400 collectives" not in report.summary
    assert report.incomplete[0].startswith("the run was interrupted: its supervisor (moedoctor pid 4242")
    assert any("in flight at the stop, not a desync" in line for line in report.incomplete)
    assert not report.problem_found


def test_an_interrupted_run_whose_rank_fell_behind_long_before_keeps_its_finding():
    a, b = _loop(100, ahead=1, gap=5.0)  # rank 1 issued nothing for 5 s before the stop
    report = analyze(run_of(a, b, manifest_info=_killed_supervisor(manifest(exits={}, hang=False))))
    assert report.verdict not in (Verdict.HEALTHY, Verdict.INTERRUPTED), report.summary
    assert report.divergence is not None and report.culprit_ranks == [1], report.summary
    assert report.incomplete[0].startswith("the run was interrupted"), report.incomplete


def _killed(first_failure: set[int]):
    a, b = _loop(50, ahead=1)
    info = manifest(exits={0: -15, 1: -9}, hang=False)
    info.exits = {r: dataclasses.replace(e, first_failure=r in first_failure) for r, e in info.exits.items()}
    return analyze(run_of(a, b, manifest_info=info))


def test_a_rank_killed_from_outside_leads_the_headline():
    report = _killed({1})
    assert report.verdict == Verdict.CRASHED, report.summary
    assert report.summary.startswith(
        "Crashed: rank 1 died (SIGKILL, killed from outside the job) first; rank 0 then ended (SIGTERM)."
    ), report.summary
    assert "rank 0 was killed with SIGTERM (exit -15) by the launcher, after rank 1 failed" in report.evidence
    assert any(e.startswith("rank 1 was killed with SIGKILL (exit -9) from outside the job") for e in report.evidence)


def test_without_a_root_cause_no_rank_is_said_killed_from_outside():
    for first in (set(), {0, 1}):  # not recorded (older manifests), or two nodes naming one each
        report = _killed(first)
        assert "from outside" not in report.summary and "ranks 0,1 died" in report.summary, report.summary


def test_a_stopped_rank_whose_last_record_is_missing_names_where_the_others_wait():
    # Rank 1 stopped right after its all_gather #201 returned, before its record was written: rank 0
    # completed #201 and waits in all_reduce #202.
    a, b = _loop(100, ahead=2)
    frozen = stack(1, ("main", "/job/train.py", 25), state="TTTT", wchan="do_signal_stop")
    waiting = stack(0, ("all_reduce", "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 3252),
                    ("main", "/job/train.py", 26), state="SSSS")
    report = analyze(run_of(a, b, stacks=[frozen, waiting], manifest_info=manifest(exits={}, hang=True)))
    assert report.pattern == "rank-stopped" and report.culprit_ranks == [1], report.summary
    assert "rank 0 waits in all_reduce #202 of group" in report.summary, report.summary
    assert "all_gather #201" not in report.summary, report.summary
    assert "rank 1's trace ends before all_gather #201" in report.culprit_reasoning, report.culprit_reasoning
    assert any("rank 0 completed all_gather #201, so rank 1 issued it too" in e for e in report.evidence)
