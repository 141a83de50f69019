"""The straggler that never comes back (issue 28, round six): rank 0 waits in an all-reduce until its
own collective timeout raises, rank 1 never issued it. ``straggler`` is named on that crash only from
what shows rank 1 was still working (``moedoctor run``'s busy record over the wait) and did not crash
(no exception, not the launcher's first failure, ended by the teardown signal)."""

from __future__ import annotations

import dataclasses

from event_factory import manifest, ranks, run_of

from moedoctor.analysis import analyze
from moedoctor.analysis.model import Verdict
from moedoctor.events import Phase
from moedoctor.run_records import BusyRecord

WAIT = 60.0


def _run(*, root_exit: int = -15, root_raises: bool = False, root_first: bool = False, busy: float = 59.0,
         root_state: str = "working"):
    bs = ranks(2)
    for step in (0, 1):
        for b in bs:
            b.coll("all_reduce", (8,), phase=Phase.BACKWARD, step=step, line=66)
    bs[0].coll("all_reduce", (8,), phase=Phase.BACKWARD, step=2, line=66, done=False)
    began = bs[0].time
    bs[0].time = began + WAIT
    bs[0].exc("RuntimeError", "Timed out waiting 60000ms for recv operation to complete",
              (("/job/train.py", 66, "main"),), step=2)
    if root_raises:
        bs[1].time = began + 5
        bs[1].exc("ValueError", "bad crop", (("/job/train.py", 37, "crop"),), phase=Phase.OTHER, step=2)
    info = manifest({0: 1, 1: root_exit}, hang=False)
    info.exits = {r: dataclasses.replace(e, first_failure=(r == 1) == root_first) for r, e in info.exits.items()}
    info.hang = None
    info.busy = [BusyRecord(began + 0.5, busy, "busy", "busy: rank 1 working in crop (train.py:37)",
                            {"0": "waiting", "1": root_state}, ended=True)]
    return analyze(run_of(*bs, manifest_info=info))


def test_a_rank_still_working_when_the_others_timed_out_is_the_straggler():
    report = _run()
    assert report.verdict == Verdict.CRASHED
    assert report.pattern == "straggler" and report.culprit_ranks == [1], report.summary
    assert report.mechanism.mechanism.value == "rank-outside-collective"
    assert "still working outside any collective" in report.summary


def test_a_rank_that_crashed_or_died_of_its_own_is_no_straggler():
    for kw in ({"root_raises": True, "root_exit": 1}, {"root_exit": 1}, {"root_first": True},
               {"root_exit": -11}):
        report = _run(**kw)
        assert report.pattern != "straggler", (kw, report.summary)
        assert report.verdict == Verdict.CRASHED


def test_without_a_busy_record_over_the_wait_nothing_shows_it_was_working():
    for kw in ({"busy": 10.0}, {"root_state": "waiting"}):
        report = _run(**kw)
        assert report.pattern != "straggler", (kw, report.summary)
