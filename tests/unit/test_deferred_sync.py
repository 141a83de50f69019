"""Ranks that disagree on which backward pass synchronises gradients (DDP ``no_sync`` on all but the
last micro-batch, a different number of micro-batches per rank): a micro-batch count mismatch, even
though the collective at the divergence is a small all_reduce issued once per micro-batch (which alone
looks like a misplaced metric all_reduce). Held-out corpus 20's DDP token-budget packer."""

from __future__ import annotations

from moedoctor.analysis import analyze
from moedoctor.events import Phase
from tests.event_factory import ranks, run_of

F, B = Phase.FORWARD, Phase.BACKWARD


def _job(micro_batches: dict[int, int], no_sync_habit: bool = True):
    """Step 0: two micro-batches on both ranks; step 1: ``micro_batches[rank]`` of them. Every forward
    all-reduces a 4-float load (line 53); only the last micro-batch's backward all-reduces the gradient
    bucket (line 147); without ``no_sync_habit`` every backward of step 0 does."""
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            n = 2 if step == 0 else micro_batches[r.rank]
            for mb in range(n):
                stuck = step == 1 and mb == 1 and r.rank == 1
                r.coll("all_reduce", (4,), phase=F, step=step, line=53, function="forward", done=step == 0)
                if stuck:
                    break
                r.ev("backward_begin", step)
                if (step == 0 and not no_sync_habit) or mb == n - 1:
                    r.coll("all_reduce", (5810,), phase=B, step=step, line=147, done=step == 0)
                    if step == 1:
                        break
                r.ev("backward_end", step)
            if step == 0:
                r.ev("grad_norm", step, norm=1.0, finite=True, site="/job/train.py:150")
                r.ev("optimizer_step_begin", step)
                r.ev("optimizer_step_end", step)
    return run_of(a, b, hang=True)


def test_a_rank_that_synced_after_fewer_micro_batches_is_the_culprit():
    report = analyze(_job({0: 1, 1: 2}))
    assert report.pattern == "microbatch-count-mismatch", [(c.pattern, c.score) for c in report.candidates]
    assert report.culprit_ranks == [0]
    assert any("disagree on which micro-batch is the step's last" in e for e in report.evidence)
    metric = next(c for c in report.candidates if c.pattern == "inflight-metric-allreduce")
    assert metric.score <= 0.1 and "synchronises gradients" in metric.evidence[0]


def test_without_the_no_sync_habit_a_backward_without_collectives_is_not_taken_for_a_deferred_sync():
    """A job that reduced in every backward pass and, once, issued nothing in one (its buckets held
    back for a gradient that never came): no claim about which micro-batch is the last."""
    report = analyze(_job({0: 1, 1: 2}, no_sync_habit=False))
    assert not any("disagree on which micro-batch" in e for c in report.candidates for e in c.evidence)
    metric = next(c for c in report.candidates if c.pattern == "inflight-metric-allreduce")
    assert not any("synchronises gradients" in e for e in metric.evidence)
