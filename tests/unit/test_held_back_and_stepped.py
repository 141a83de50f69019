"""Two readings of corpus 26's mechanism misses, on factory-built events.

Gradient reductions held back past a metric: a rank whose backward pass ended with fewer of the
reductions its pass issues (a hook that did not fire, a bucket left for a later flush) and that then
issued a collective outside any pass, where the others, in the same backward pass, issue the next
reduction, reordered them (``different-op``), it did not leave a loop nor skip them.

A rank that stepped while the others began another micro-batch: its collective is the first of the
next step (an optimizer step between), the others issue again the collective that opens each pass of
the step, a pass their earlier steps show room for: ``loop-trip-count`` (the stepping rank ran fewer
passes) and ``microbatch-count-mismatch`` with the stepping rank as culprit; not when the earlier
steps never ran that many passes or the restarting rank cleared its gradients first (the next
iteration of a rank that skipped its optimizer step).
"""

from __future__ import annotations

from event_factory import ranks, run_of

from moedoctor.analysis import analyze
from moedoctor.analysis.mechanisms.vocabulary import Mechanism
from moedoctor.events import Phase


def _hooks(passes_a: int = 1):
    """Step 0, one backward pass: gradient reductions from a hook (line 46), then a metric (line 111).
    Rank 0 ends its pass after four reductions and issues its metric; rank 1 issues a fifth
    (``passes_a`` 2: rank 0 ran another backward pass before its reductions)."""
    a, b = ranks(2)
    for r in (a, b):
        r.ev("backward_begin", 0)
    for _ in range(passes_a - 1):
        a.ev("backward_end", 0)
        a.ev("backward_begin", 0)
    for _ in range(4):
        a.coll("all_reduce", (8, 8), phase=Phase.BACKWARD, step=0, line=46)
        b.coll("all_reduce", (8, 8), phase=Phase.BACKWARD, step=0, line=46)
    b.coll("all_reduce", (8, 8), phase=Phase.BACKWARD, step=0, line=46, done=False)
    a.ev("backward_end", 0)
    a.coll("all_reduce", (2,), phase=Phase.OTHER, step=0, line=111, done=False)
    return run_of(a, b, hang=True)


def test_reductions_held_back_past_a_metric_are_a_different_op():
    report = analyze(_hooks())
    assert report.mechanism.mechanism == Mechanism.DIFFERENT_OP, report.mechanism
    assert report.mechanism.ranks == (0,), report.mechanism


def test_a_rank_in_another_backward_pass_is_not_read_as_held_back():
    report = analyze(_hooks(passes_a=2))
    assert report.mechanism.mechanism != Mechanism.DIFFERENT_OP or "held back" not in report.mechanism.detail


def _buckets(last_step: int = 2):
    """Each step: two buckets in backward (lines 56, sizes 136 and 2224), then a metric (line 108).
    In the last step rank 0's second bucket is left for a later flush: it issues its metric where rank
    1 issues the bucket."""
    a, b = ranks(2)
    for s in range(last_step + 1):
        for r in (a, b):
            r.ev("zero_grad", s)
            r.ev("backward_begin", s)
            r.coll("all_reduce", (136,), phase=Phase.BACKWARD, step=s, line=56)
            if s == last_step and r is a:
                r.ev("backward_end", s)
                r.coll("all_reduce", (1,), phase=Phase.OTHER, step=s, line=108, done=False)
                continue
            r.coll("all_reduce", (2224,), phase=Phase.BACKWARD, step=s, line=56, done=s < last_step)
            if s == last_step:
                continue
            r.ev("backward_end", s)
            r.coll("all_reduce", (1,), phase=Phase.OTHER, step=s, line=108)
            r.ev("optimizer_step_begin", s)
            r.ev("optimizer_step_end", s + 1)
    return run_of(a, b, hang=True)


def test_a_bucket_held_back_behind_a_metric_is_no_skip():
    """The history says the 2224 bucket follows the 136 one, and rank 0's metric is what comes after
    it: by alignment alone a skip; its backward pass ended since its previous collective, so the
    bucket was held back (a reordering)."""
    report = analyze(_buckets())
    assert report.mechanism.mechanism == Mechanism.DIFFERENT_OP, report.mechanism
    assert report.mechanism.ranks == (0,), report.mechanism


def _microbatches(first_step_passes: int = 2, clear: bool = False):
    """Step 0: ``first_step_passes`` micro-batches on both ranks (a forward all-gather at line 90, a
    reduce-scatter in backward at line 92), then the optimizer step; step 1 opens with a loss
    all-reduce (line 96) and runs one micro-batch; then rank 0 begins a second one (line 90) while
    rank 1 steps and issues step 2's loss all-reduce."""
    a, b = ranks(2)
    for r in (a, b):
        r.ev("zero_grad", 0)
        for _ in range(first_step_passes):
            r.coll("all_gather", (5,), phase=Phase.FORWARD, step=0, line=90)
            r.ev("backward_begin", 0)
            r.coll("reduce_scatter", (10,), phase=Phase.BACKWARD, step=0, line=92)
            r.ev("backward_end", 0)
        r.ev("optimizer_step_begin", 0)
        r.ev("optimizer_step_end", 1)
        r.ev("zero_grad", 1)
        r.coll("all_reduce", (1,), phase=Phase.OTHER, step=1, line=96)
        r.coll("all_gather", (5,), phase=Phase.FORWARD, step=1, line=90)
        r.ev("backward_begin", 1)
        r.coll("reduce_scatter", (10,), phase=Phase.BACKWARD, step=1, line=92)
        r.ev("backward_end", 1)
    if clear:
        a.ev("zero_grad", 1)
    a.coll("all_gather", (5,), phase=Phase.FORWARD, step=1, line=90, done=False)
    b.ev("optimizer_step_begin", 1)
    b.ev("optimizer_step_end", 2)
    b.coll("all_reduce", (1,), phase=Phase.OTHER, step=2, line=96, done=False)
    return run_of(a, b, hang=True)


def test_a_rank_that_stepped_while_the_other_began_another_micro_batch_ran_fewer():
    report = analyze(_microbatches())
    assert report.mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert report.mechanism.ranks == (1,), report.mechanism
    assert report.pattern == "microbatch-count-mismatch" and report.culprit_ranks == [1], report.pattern


def test_a_pass_the_earlier_steps_never_ran_is_not_another_micro_batch():
    report = analyze(_microbatches(first_step_passes=1))
    assert report.mechanism.mechanism != Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert report.pattern != "microbatch-count-mismatch", report.pattern


def test_a_rank_that_cleared_its_gradients_first_is_in_the_next_iteration():
    report = analyze(_microbatches(clear=True))
    assert report.mechanism.mechanism != Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert report.pattern != "microbatch-count-mismatch", report.pattern
