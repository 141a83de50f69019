"""Level 1, the mechanism (``moedoctor.analysis.mechanisms``): what the traces and the ranks' states
show, on factory-built runs and synthetic stacks."""

from __future__ import annotations

from event_factory import in_collective, manifest, ranks, run_of, stack

from moedoctor.analysis import analyze
from moedoctor.analysis.from_stacks import report_from_stacks
from moedoctor.analysis.mechanisms.wording import suggestion
from moedoctor.analysis.mechanisms.vocabulary import Mechanism, RankState
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
    assert "rank 0 ran 4, rank 1 ran 3 iterations of train.py:14" in suggestion(mech).text


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


def _zero1(steps: int):
    """A functional ZeRO-1 step with no optimizer hooks (the step counter stays 0): reduce_scatter
    at train.py:57, all_gather at train.py:69, ``steps`` times on both ranks."""
    a, b = ranks(2)
    for _ in range(steps):
        for r in (a, b):
            r.coll("reduce_scatter", (388,), line=57)
            r.coll("all_gather", (194,), line=69)
    return a, b


def test_a_rank_whose_collective_is_the_one_after_the_expected_one_skipped_it():
    """Rank 0 leaves out its update's all_gather and issues the next step's reduce_scatter where
    rank 1, as the shared history says, all-gathers: rank 0 skipped one (not a different op)."""
    a, b = _zero1(2)
    for r in (a, b):
        r.coll("reduce_scatter", (388,), line=57)
    a.coll("reduce_scatter", (388,), line=57, done=False)
    b.coll("all_gather", (194,), line=69, done=False)
    mech = analyze(run_of(a, b, hang=True)).mechanism
    assert mech.mechanism == Mechanism.SKIPPED_COLLECTIVE and mech.ranks == (0,) and mech.seq == 6, mech
    assert "left out 1 collective" in mech.detail


def test_ranks_that_part_before_the_matched_divergence_are_aligned_where_they_part():
    """Same op and size at #7 (they pair silently), other FSDP units: rank 1 left out units e0 and
    e1 of the expert loop; the matcher's mismatch shows only at #8."""
    from analysis_scenarios import units_skipped

    report = analyze(units_skipped("moe.experts."))
    mech = report.mechanism
    assert report.divergence.seq == 8
    assert mech.mechanism == Mechanism.SKIPPED_COLLECTIVE and mech.ranks == (1,) and mech.seq == 7, mech
    assert "left out 2 collectives" in mech.detail


def test_a_collective_issued_later_was_reordered_not_skipped():
    """Rank 2 issues the metric all-reduce before the head's all_gather, then the all_gather: the
    history's next collective comes later in its stream, a reordering (different op)."""
    rs = ranks(3)
    for r in rs:
        for step in range(2):
            r.coll("all_gather", (104,), phase=Phase.FORWARD, step=step, line=33, module="trunk")
            r.coll("all_gather", (13,), phase=Phase.FORWARD, step=step, line=39, module="head")
            r.coll("all_reduce", (1,), step=step, line=44)
        r.coll("all_gather", (104,), phase=Phase.FORWARD, step=2, line=33, module="trunk")
    for r in rs[:2]:
        r.coll("all_gather", (13,), phase=Phase.FORWARD, step=2, line=39, module="head", done=False)
    rs[2].coll("all_reduce", (1,), step=2, line=44)
    rs[2].coll("all_gather", (13,), phase=Phase.FORWARD, step=2, line=39, module="head", done=False)
    mech = analyze(run_of(*rs, hang=True)).mechanism
    assert mech.mechanism != Mechanism.SKIPPED_COLLECTIVE, mech


def test_a_repeat_the_history_never_shows_is_an_extra_collective():
    """Every rank all-reduces an eval metric once (train.py:29); rank 0 then issues it a second
    time while rank 1 goes on to the step's first gradient all-reduce, as every earlier step began."""
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_reduce", (32, 10), step=step, line=64)
            r.coll("all_reduce", (32,), step=step, line=64)
    for r in (a, b):
        r.coll("all_reduce", (), step=3, line=29)
    a.coll("all_reduce", (), step=3, line=29, done=False)
    b.coll("all_reduce", (32, 10), step=3, line=64, done=False)
    mech = analyze(run_of(a, b, hang=True)).mechanism
    assert mech.mechanism == Mechanism.EXTRA_COLLECTIVE and mech.ranks == (0,), mech


def test_one_period_of_history_does_not_tell_a_repeat_from_a_skip():
    """After a single step [reduce_scatter, all_gather, all_reduce], rank 1 all-reduces again where
    rank 0 begins the next step: it may have skipped the step's first two (a skipped optimizer step)
    as well as repeated the last one; neither extra nor skipped is claimed."""
    a, b = ranks(2)
    for r in (a, b):
        r.coll("reduce_scatter", (450,), line=98)
        r.coll("all_gather", (225,), line=109)
        r.coll("all_reduce", (1,), line=164)
    a.coll("reduce_scatter", (450,), line=98, done=False)
    b.coll("all_reduce", (1,), line=164, done=False)
    mech = analyze(run_of(a, b, hang=True)).mechanism
    assert mech.mechanism not in (Mechanism.EXTRA_COLLECTIVE, Mechanism.SKIPPED_COLLECTIVE), mech


def test_a_history_whose_continuation_varies_does_not_say_who_skipped():
    """The context before the divergence was followed once by one collective and once by another
    (a loop whose count varies): no side is the normal one, no skip is claimed from it."""
    a, b = ranks(2)
    for r in (a, b):
        for n in (1, 2):
            for _ in range(n):
                r.coll("all_gather", (8,), line=30)
                r.coll("all_reduce", (1,), line=40)
            r.coll("broadcast", (4,), line=50)
        r.coll("all_gather", (8,), line=30)
        r.coll("all_reduce", (1,), line=40)
    a.coll("all_gather", (8,), line=30, done=False)
    b.coll("broadcast", (4,), line=50, done=False)
    from moedoctor.analysis.mechanisms.alignment import expected_next
    from moedoctor.analysis.evidence.steps import shape_token

    history = [shape_token(e) for e in a.events[:-1]]
    assert expected_next(history) is None


def test_a_rank_sleeping_in_the_autograd_engine_waits_in_a_collective_torch_runs_from_cpp():
    """DDP's reducer all-reduces gradient buckets from C++ autograd hooks: a rank blocked in it shows
    only ``_engine_run_backward`` and sleeps. It is not working in its own code, so the stacks show
    ranks in different collectives, not a straggler; a rank running there (``R``) is still outside."""
    torch = "/usr/lib/python3/site-packages/torch"
    in_backward = (("_engine_run_backward", f"{torch}/autograd/graph.py", 979), ("main", TRAIN, 68))
    asleep = {0: in_collective(0, 30), 1: stack(1, *in_backward, state="S")}
    report = report_from_stacks(asleep, source="x")
    assert report.mechanism.mechanism == Mechanism.DIFFERENT_OP and report.pattern != "straggler", report.summary
    running = {0: in_collective(0, 30), 1: stack(1, *in_backward, state="R")}
    mech = report_from_stacks(running, source="x").mechanism
    assert (mech.mechanism, mech.state) == (Mechanism.RANK_OUTSIDE, RankState.WORKING)
