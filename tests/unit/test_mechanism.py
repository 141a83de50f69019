"""Level 1, the mechanism (``moedoctor.analysis.mechanism``): what the traces and the ranks' states
show, on factory-built runs and synthetic stacks."""

from __future__ import annotations

from event_factory import in_collective, manifest, ranks, run_of, stack

from moedoctor.analysis import analyze
from moedoctor.analysis.from_stacks import report_from_stacks
from moedoctor.analysis.mechanism import Mechanism, RankState
from moedoctor.events import Phase

TRAIN = "/job/train.py"


def _loop(rank1_iterations: int, **kw):
    """Both ranks all-reduce once per item at train.py:14 (4 items at step 0); at step 1 rank 0
    issues 4 and waits in the 4th, rank 1 stops after ``rank1_iterations``."""
    a, b = ranks(2)
    for r in (a, b):
        for _ in range(4):
            r.coll("all_reduce", (8,), phase=Phase.OTHER, step=0, line=14)
        r.coll("barrier", (), phase=Phase.OTHER, step=0, line=20)
    for i in range(4):
        a.coll("all_reduce", (8,), phase=Phase.OTHER, step=1, line=14, done=i < 3)
    for _ in range(rank1_iterations):
        b.coll("all_reduce", (8,), phase=Phase.OTHER, step=1, line=14)
    return run_of(a, b, **kw)


def test_a_rank_that_ended_after_fewer_iterations_ran_the_loop_fewer_times():
    report = analyze(_loop(3, manifest_info=manifest({0: None, 1: 0})))
    mech = report.mechanism
    assert mech.mechanism == Mechanism.LOOP_TRIP_COUNT and mech.counts == {0: 4, 1: 3}, mech
    assert mech.ranks == (1,) and mech.loop_site == f"{TRAIN}:14" and mech.step == 1
    assert "rank 0 ran 4, rank 1 ran 3 iterations of train.py:14" in mech.suggestion().text


def test_a_rank_that_issued_nothing_since_its_last_iteration_has_not_left_the_loop():
    """No stack, no exit: the rank may still come (a straggler), so it is only outside any collective."""
    report = analyze(_loop(3, hang=True))
    mech = report.mechanism
    assert mech.mechanism == Mechanism.RANK_OUTSIDE and mech.ranks == (1,), mech
    assert mech.state == RankState.UNKNOWN


def test_the_state_of_the_rank_outside_comes_from_its_stack_process_and_exit():
    working = stack(1, ("tokenize", TRAIN, 40), ("main", TRAIN, 60))
    report = analyze(_loop(3, hang=True, stacks=[in_collective(0, 14), working]))
    assert (report.mechanism.mechanism, report.mechanism.state) == (Mechanism.RANK_OUTSIDE, RankState.WORKING)
    assert report.pattern == "straggler"
    stopped = stack(1, ("tokenize", TRAIN, 40), ("main", TRAIN, 60), state="T")
    report = analyze(_loop(3, hang=True, stacks=[in_collective(0, 14), stopped]))
    assert report.mechanism.state == RankState.STOPPED and report.pattern == "rank-stopped"


def test_a_busy_rank_is_not_an_extra_collective_of_the_waiting_one():
    """The waiting rank's collective is new (no rank issued it before), the other rank works in
    its own code: a rank outside, never an extra collective (rank-conditional's mechanism)."""
    a, b = ranks(2)
    for r in (a, b):
        r.coll("all_reduce", (8,), step=0, line=14)
    a.coll("all_gather", (8,), step=0, line=30, done=False)
    busy = stack(1, ("preprocess", TRAIN, 50), ("main", TRAIN, 60))
    report = analyze(run_of(a, b, hang=True, stacks=[in_collective(0, 30), busy]))
    assert report.mechanism.mechanism == Mechanism.RANK_OUTSIDE and report.mechanism.ranks == (1,)
    assert report.pattern != "rank-conditional-collective"


def test_a_collective_no_other_rank_ever_issued_is_an_extra_one():
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            r.coll("all_reduce", (8,), step=step, line=14)
            r.coll("barrier", (), step=step, line=16)
    a.coll("all_reduce", (1,), dtype="float64", step=2, line=40, done=False)  # only rank 0, a new call site
    b.coll("all_reduce", (8,), step=2, line=14, done=False)
    report = analyze(run_of(a, b, hang=True))
    assert report.mechanism.mechanism == Mechanism.EXTRA_COLLECTIVE and report.mechanism.ranks == (0,)


def test_stacks_alone_say_outside_stopped_transport_or_different_ops():
    outside = {0: in_collective(0, 14), 1: stack(1, ("read", TRAIN, 43), ("main", TRAIN, 70))}
    mech = report_from_stacks(outside, source="x").mechanism
    assert (mech.mechanism, mech.state, mech.ranks) == (Mechanism.RANK_OUTSIDE, RankState.WORKING, (1,))
    same = {r: in_collective(r, 14) for r in (0, 1)}
    assert report_from_stacks(same, source="x").mechanism.mechanism == Mechanism.TRANSPORT_HANG
    other = {0: in_collective(0, 14), 1: in_collective(1, 30)}
    assert report_from_stacks(other, source="x").mechanism.mechanism == Mechanism.DIFFERENT_OP
    assert report_from_stacks({0: outside[1]}, source="x").mechanism is None  # nobody waits in a collective
