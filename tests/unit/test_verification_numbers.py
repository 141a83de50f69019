"""What ``moedoctor verify`` compares: losses by (rank, backward ordinal), step times on the steps
both runs completed."""

from __future__ import annotations

import math

from moedoctor.verification.numbers import RunNumbers, compare_losses, compare_step_times


def test_losses_before_the_hang_must_come_back():
    before = RunNumbers(losses={0: {0: 2.0, 1: 1.5}, 1: {0: 2.1, 1: 1.6, 2: 1.4}})
    after = RunNumbers(losses={0: {0: 2.0, 1: 1.5000001, 2: 1.3, 3: 1.2}, 1: {0: 2.1, 1: 1.6, 2: 1.4, 3: 1.1}})
    result = compare_losses(before, after)
    assert (result.compared, result.matched, result.passed) == (5, 5, True)
    assert 0 < result.worst_relative < 1e-6


def test_a_different_or_missing_loss_fails():
    before = RunNumbers(losses={0: {0: 2.0, 1: 1.5}, 1: {0: 2.1}})
    after = RunNumbers(losses={0: {0: 2.0, 1: 1.6}})
    result = compare_losses(before, after)
    assert not result.passed and result.matched == 1
    assert any("1.5 vs 1.6" in m for m in result.mismatches)
    assert any("rank 1 loss #0" in m and "nothing" in m for m in result.mismatches)


def test_nothing_to_compare_is_not_a_pass():
    assert not compare_losses(RunNumbers(), RunNumbers(losses={0: {0: 1.0}})).passed


def test_nan_matches_nan():
    nan = float("nan")
    assert compare_losses(RunNumbers(losses={0: {0: nan}}), RunNumbers(losses={0: {0: nan}})).passed


def test_step_times_on_common_steps_slowest_rank():
    # step_ends: rank -> step -> time; a step's duration is end(s) - end(s-1), the slowest rank's.
    before = RunNumbers(step_ends={0: {1: 10.0, 2: 10.1}, 1: {1: 10.0, 2: 10.2}})
    after = RunNumbers(step_ends={0: {1: 5.0, 2: 5.1, 3: 5.2, 4: 5.5}, 1: {1: 5.0, 2: 5.1, 3: 5.2, 4: 5.3}})
    times = compare_step_times(before, after)
    assert times.steps == (2,)
    assert math.isclose(times.before, 0.2) and math.isclose(times.after, 0.1)
    assert math.isclose(times.change, -0.5)
    assert math.isclose(times.after_all, 0.1)


def test_too_few_steps_gives_no_comparison():
    times = compare_step_times(RunNumbers(step_ends={0: {1: 1.0}}), RunNumbers(step_ends={0: {1: 1.0, 2: 2.0}}))
    assert times.steps == () and times.before is None and times.change is None
