"""A collective issued from inside the micro-batch loop that the other ranks go round again is an
extra collective within an iteration (``inflight-metric-allreduce``'s trace), not a loop left early
(``microbatch-count-mismatch``): ``source.same_loop``, the mechanism and both patterns, on
factory-built events whose call sites point into a small source file."""

from __future__ import annotations

from event_factory import ranks, run_of

from moedoctor.analysis import analyze
from moedoctor.analysis.mechanisms.vocabulary import Mechanism
from moedoctor.analysis.evidence.source import same_loop
from moedoctor.events import Phase

SOURCE = """\
for step in range(steps):
    for mb in range(accum):
        out = model(batch(mb))
        out.backward()
        dist.all_reduce(loss)
        if imbalance > 3.0:
            dist.all_reduce(alert)
    clip_grad_norm_(model.parameters())
    dist.all_reduce(total)
    opt.step()
"""


def _file(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    return str(path)


def _run(path: str, last_line: int):
    """Two micro-batches on both ranks in step 0; then rank 0 begins another pass (the forward
    all-gather at line 3) while rank 1 issues the collective at ``last_line``."""
    a, b = ranks(2)
    for r in (a, b):
        for _ in range(2):
            r.coll("all_gather", (2048,), phase=Phase.FORWARD, step=0, line=3, file=path, module="layers.0")
            r.ev("backward_begin", 0)
            r.coll("reduce_scatter", (2048,), phase=Phase.BACKWARD, step=0, line=4, file=path, module="layers.0")
            r.ev("backward_end", 0)
            r.coll("all_reduce", (), phase=Phase.OTHER, step=0, line=5, file=path)
    a.coll("all_gather", (2048,), phase=Phase.FORWARD, step=0, line=3, file=path, module="layers.0", done=False)
    b.coll("all_reduce", (), phase=Phase.OTHER, step=0, line=last_line, file=path, done=False)
    return run_of(a, b, hang=True)


def test_same_loop_is_the_nested_loop_enclosing_both_calls(tmp_path):
    path = _file(tmp_path)
    loop = same_loop((f"{path}:7 <module>",), (f"{path}:3 <module>",))
    assert loop is not None and loop.line == 2
    assert same_loop((f"{path}:9 <module>",), (f"{path}:3 <module>",)) is None  # after the loop: it left


def test_the_training_step_loop_is_not_a_micro_batch_loop(tmp_path):
    path = tmp_path / "flat.py"
    path.write_text("for step in range(steps):\n    out = model(x)\n    out.backward()\n    check(out)\n")
    assert same_loop((f"{path}:4 <module>",), (f"{path}:2 <module>",)) is None


def test_a_collective_inside_the_loop_the_others_go_round_again_is_an_extra_one(tmp_path):
    report = analyze(_run(_file(tmp_path), 7))
    assert report.mechanism.mechanism == Mechanism.EXTRA_COLLECTIVE, report.mechanism
    assert report.mechanism.ranks == (1,)
    assert report.pattern != "microbatch-count-mismatch"


def test_a_collective_after_the_loop_closes_the_step_a_loop_left_early(tmp_path):
    report = analyze(_run(_file(tmp_path), 9))
    assert report.mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert report.pattern == "microbatch-count-mismatch" and report.culprit_ranks == [1], report.pattern


ACCUM = """\
for step in range(steps):
    for i, b in enumerate(batches):
        with (nullcontext() if i == len(batches) - 1 else model.no_sync()):
            dist.all_reduce(natoms)
            loss = model(b) / natoms
            loss.backward()
    opt.step()
"""


def _first_step(tmp_path):
    """Step 0, no earlier step: both ranks all-reduce a count per micro-batch (line 4), rank 1 has
    two micro-batches and syncs its gradients in the second backward pass (line 6), rank 0 ran that
    pass to its end without a collective and all-reduces the count of a third micro-batch."""
    path = tmp_path / "accum.py"
    path.write_text(ACCUM)
    a, b = ranks(2)
    for r in (a, b):
        for _ in range(2):
            r.coll("all_reduce", (), phase=Phase.OTHER, step=0, line=4, file=str(path))
            r.ev("backward_begin", 0)
            if r is a:
                r.ev("backward_end", 0)
    a.coll("all_reduce", (), phase=Phase.OTHER, step=0, line=4, file=str(path), done=False)
    b.coll("all_reduce", (4097,), phase=Phase.BACKWARD, step=0, line=6, file=str(path), done=False)
    return run_of(a, b, hang=True)


def test_a_gradient_sync_the_metric_rank_ran_past_in_the_first_step_is_not_a_metric(tmp_path):
    """The metric reading needs the others' collective to be in flight; a backward pass the small
    rank finished without it may be where the others synchronise gradients (no history to tell)."""
    report = analyze(_first_step(tmp_path))
    assert report.pattern != "inflight-metric-allreduce", report.pattern


def test_a_call_site_issued_again_in_backward_after_forward_is_no_loop_iteration():
    """Both ranks issue a statistics all-reduce twice in forward (line 44); in backward rank 0
    issues it a third time (a recompute) while rank 1 goes on: a re-issue within another pass,
    not a per-item loop that rank 1 left early."""
    a, b = ranks(2)
    for r in (a, b):
        for _ in range(2):
            r.coll("all_reduce", (65,), phase=Phase.FORWARD, step=0, line=44)
        r.ev("backward_begin", 0)
    a.coll("all_reduce", (65,), phase=Phase.BACKWARD, step=0, line=44, done=False)
    b.coll("all_reduce", (32, 20), phase=Phase.OTHER, step=0, line=110, done=False)
    report = analyze(run_of(a, b, hang=True))
    assert report.mechanism.mechanism != Mechanism.LOOP_TRIP_COUNT, report.mechanism


def _held_back(in_backward: bool):
    """Three micro-batches on both ranks, a metric all-reduce after each backward pass (line 120);
    rank 0's gradient bucket was held back (a hook waiting for a gradient) and it issued the metric of
    the third pass, while rank 1 goes on after its second metric with a collective in its third
    backward pass (its bucket, line 65) or, ``in_backward`` False, outside any pass (line 140)."""
    a, b = ranks(2)
    for i in range(3):
        for r in (a, b):
            if r is b and i == 2 and not in_backward:
                r.coll("all_reduce", (5956,), phase=Phase.OTHER, step=0, line=140, done=False)
                continue
            r.ev("backward_begin", 0)
            if r is b and i == 2:
                r.coll("all_reduce", (5956,), phase=Phase.BACKWARD, step=0, line=65, done=False)
                continue
            r.ev("backward_end", 0)
            r.coll("all_reduce", (2,), phase=Phase.OTHER, step=0, line=120, done=i < 2)
    return run_of(a, b, hang=True)


def test_a_rank_in_the_same_backward_pass_did_not_leave_the_loop():
    """Rank 1 began as many backward passes as rank 0: still in the loop that runs them, the ranks
    disagree within one iteration, not on the loop's trip count (RecBole's held-back bucket)."""
    report = analyze(_held_back(True))
    assert report.mechanism.mechanism != Mechanism.LOOP_TRIP_COUNT, report.mechanism


def test_a_rank_that_went_on_outside_the_passes_left_the_loop():
    report = analyze(_held_back(False))
    assert report.mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT, report.mechanism
