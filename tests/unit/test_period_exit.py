"""A loop of one optimizer step per iteration (one gradient all-reduce each) between two issues of a
per-update collective: a rank that issues the per-update one after fewer iterations than the
previous update, while the others are still in the loop, left it early (``loop-trip-count``, a PPO
update-epochs loop stopped on one rank's local KL), on factory-built events."""

from __future__ import annotations

from event_factory import ranks, run_of

from moedoctor.analysis import analyze
from moedoctor.analysis.mechanisms.vocabulary import Mechanism
from moedoctor.events import Phase


def _run(short: int):
    """Update 0: four steps of a gradient all-reduce (line 73), then a per-update all-reduce (line
    87) on both ranks. Update 1: rank 1 runs ``short`` steps and issues line 87 while rank 0 runs a
    third step."""
    a, b = ranks(2)
    step = 0
    for r in (a, b):
        for s in range(4):
            r.coll("all_reduce", (452,), phase=Phase.OTHER, step=s, line=73)
        r.coll("all_reduce", (1,), phase=Phase.OTHER, step=4, line=87)
    for s in range(3):
        step = 4 + s
        a.coll("all_reduce", (452,), phase=Phase.OTHER, step=step, line=73, done=s < 2)
    for s in range(short):
        b.coll("all_reduce", (452,), phase=Phase.OTHER, step=4 + s, line=73)
    b.coll("all_reduce", (1,), phase=Phase.OTHER, step=4 + short, line=87, done=False)
    return run_of(a, b, hang=True)


def test_a_rank_that_closes_the_update_after_fewer_steps_left_the_loop():
    report = analyze(_run(2))
    assert report.mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert report.mechanism.ranks == (1,), report.mechanism
    assert report.mechanism.counts == {0: 3, 1: 2}, report.mechanism


def test_a_rank_that_ran_no_iteration_did_not_leave_a_loop():
    report = analyze(_run(0))
    assert report.mechanism.mechanism != Mechanism.LOOP_TRIP_COUNT, report.mechanism
