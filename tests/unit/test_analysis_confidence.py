"""Confidence that cannot lie: ``not-a-desync`` only when completion is observed and every rank's
stack is inside the collective (else the report names no pattern and says what it could not
establish), and a rank whose process does not run (``T``/``t``/``D``) is ``rank-stopped``, a fact
with no code fix, never an ``unknown-desync`` with "make the collective unconditional"."""

from __future__ import annotations

import pytest
from analysis_scenarios import DP, S, TP, not_a_desync, rank_stopped, shape_mismatch
from event_factory import in_collective, ranks, run_of, stack

from moedoctor.analysis import analyze
from moedoctor.analysis.model import DivergenceKind, Verdict
from moedoctor.analysis.patterns import THRESHOLD


def candidate(report, pattern: str):
    return next(c for c in report.candidates if c.pattern == pattern)


def assert_no_code_fix(report) -> None:
    assert report.fixes == [] and report.verify_command is None
    assert report.suggestion is not None and report.suggestion.call_site is None
    assert "unconditional" not in report.suggestion.text


# ---- not-a-desync needs completion and stacks -----------------------------------------------------

def test_stalled_with_completion_observed_and_stacks_in_the_collective_is_not_a_desync():
    report = analyze(not_a_desync())
    assert report.pattern == "not-a-desync" and report.verdict == Verdict.STUCK
    assert candidate(report, "not-a-desync").score == 0.9
    assert "suspect the hardware or network" in report.summary
    assert not any(e.startswith("not established") for e in report.evidence)


def test_stalled_with_completion_unknown_is_not_named_not_a_desync():
    """NCCL-like: no completion was ever observed, so "none completed it" proves nothing."""
    report = analyze(not_a_desync(completions=False))
    assert report.divergence.kind == DivergenceKind.STALLED
    assert report.pattern is None and report.verdict == Verdict.STUCK
    assert candidate(report, "not-a-desync").score < THRESHOLD
    text = "\n".join(report.evidence)
    assert "completion of collectives was not observed on ranks 0,1" in text
    assert "score 0.30 instead of 0.90" in text
    assert "suspect the hardware" not in report.summary and "cause not established" in report.summary


def test_stalled_without_a_stack_of_one_rank_is_not_named():
    report = analyze(not_a_desync(stacks=[in_collective(0, 42)]))
    assert report.pattern is None
    assert any(e == "not established: no stack for rank 1" for e in report.evidence), report.evidence
    assert candidate(report, "not-a-desync").score == 0.3


def test_stalled_with_an_unreadable_stack_and_unknown_completion_scores_lower_still():
    stacks = [in_collective(0, 42), stack(1, error="py-spy dump of pid 101 failed: timeout. more")]
    report = analyze(not_a_desync(stacks=stacks, completions=False))
    assert report.pattern is None and candidate(report, "not-a-desync").score == 0.2
    text = "\n".join(report.evidence)
    assert "rank 1's stack could not be read (py-spy dump of pid 101 failed: timeout)" in text
    assert "completion of the collectives was not observed and not every rank's stack" in text


def test_stalled_without_any_stack_is_not_named():
    report = analyze(not_a_desync(stacks=[]))
    assert report.pattern is None
    assert any("no stack was taken of any rank" in e for e in report.evidence)


def test_a_stack_outside_the_collective_contradicts_not_a_desync():
    stacks = [in_collective(0, 42), stack(1, ("compute", "/job/train.py", 77), ("main", "/job/train.py", 90))]
    report = analyze(not_a_desync(stacks=stacks))
    assert report.pattern is None and candidate(report, "not-a-desync").score == 0.1
    assert any("rank 1's main thread is in compute (train.py:77), not inside a collective" in e
               for e in report.evidence)


def test_nccl_order_inversion_without_completions_is_not_a_confident_hardware_verdict():
    """Two groups issued in opposite orders on NCCL, no completion observed: each group looks
    stalled, no wait-for cycle can be built. Formerly not-a-desync at 0.9."""
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            order = [(TP, 30), (DP, 31)]
            if step == 2 and r is b:
                order.reverse()
            for group, line in order:
                r.coll("all_reduce", (8,), group=group, phase=S, step=step, line=line, done=False)
    report = analyze(run_of(a, b, hang=True, stacks=[in_collective(0, 30), in_collective(1, 31)]))
    assert report.pattern != "not-a-desync"
    assert all(c.score < THRESHOLD for c in report.candidates if c.pattern == "not-a-desync")
    text = "\n".join(report.evidence)
    assert "completion of collectives was not observed" in text
    assert "collective order inversion across these groups cannot be ruled out" in text
    assert "suspect the hardware" not in report.summary


# ---- a rank that does not run -------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_a_stopped_rank_the_others_wait_for_is_rank_stopped_with_no_code_fix(n):
    report = analyze(rank_stopped(n=n))
    assert report.pattern == "rank-stopped" and report.verdict == Verdict.STUCK
    assert report.culprit_ranks == [1]
    assert_no_code_fix(report)
    assert "rank 1's process is stopped (state T" in report.summary and "Not a code desync" in report.summary
    text = "\n".join(report.evidence)
    assert "rank 1's process is stopped (state T" in text and "wchan do_signal_stop" in text
    assert "its last collective was all_reduce #2 of group 0 (default_pg), train.py:53, completed" in text
    assert "main thread is in main (train.py:48)" in text
    # the straggler pattern does not claim a process that does not run
    assert "straggler" not in {c.pattern for c in report.candidates}


def test_a_stopped_rank_whose_stack_py_spy_could_not_read_is_still_rank_stopped():
    report = analyze(rank_stopped(stack_error="py-spy could not read pid 101: the process is stopped. more"))
    assert report.pattern == "rank-stopped" and report.culprit_ranks == [1]
    assert_no_code_fix(report)
    assert "unknown-desync" != report.pattern


def test_a_rank_in_uninterruptible_sleep_is_rank_stopped_pointing_at_the_kernel():
    report = analyze(rank_stopped(state="D"))
    assert report.pattern == "rank-stopped"
    assert "uninterruptible sleep (state D" in report.summary
    assert "dmesg" in report.suggestion.text and "nfs_wait_bit_killable" in report.suggestion.text
    assert_no_code_fix(report)


def test_a_passing_d_state_is_not_a_frozen_rank():
    """A process goes through D on every disk read: one reading of D among others proves nothing."""
    report = analyze(rank_stopped(state="DSDD"))
    assert report.pattern != "rank-stopped"
    assert not any("uninterruptible" in e for e in report.evidence)


def test_a_stopped_rank_inside_the_stalled_collective_is_rank_stopped_not_hardware():
    stacks = [in_collective(0, 42, state="S"), in_collective(1, 42, state="T")]
    report = analyze(not_a_desync(stacks=stacks))
    assert report.pattern == "rank-stopped" and report.culprit_ranks == [1]
    assert candidate(report, "not-a-desync").score < THRESHOLD
    assert "inside torch.distributed" in "\n".join(report.evidence)
    assert_no_code_fix(report)


def test_a_proven_mismatch_stays_a_desync_and_the_stopped_rank_is_reported_beside_it():
    run = shape_mismatch()
    run.stacks = {0: in_collective(0, 50, state="S"), 1: in_collective(1, 50, state="T")}
    report = analyze(run)
    assert report.pattern == "shape-mismatch" and report.verdict == Verdict.DESYNC
    assert any(e.startswith("rank 1's process is stopped (state T") for e in report.evidence)


def test_the_score_counts_conditions_not_lines():
    """No stack of rank 0 and an unreadable one of rank 1 are one condition not established."""
    report = analyze(not_a_desync(stacks=[stack(1, error="py-spy dump of pid 101 failed: gone. more")]))
    assert candidate(report, "not-a-desync").score == 0.3
    text = "\n".join(report.evidence)
    assert "no stack for rank 0" in text and "rank 1's stack could not be read" in text
    assert "because not every rank's stack shows it inside this collective" in text
