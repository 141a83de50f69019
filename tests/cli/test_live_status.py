"""The live status line of ``moedoctor run``."""

from __future__ import annotations

from event_factory import ranks

from moedoctor.cli.live import status_line
from moedoctor.runner.launch import RankStatus, RunStatus


def test_before_the_first_collective_the_status_names_the_start_up_limit():
    line = status_line(RunStatus(10, 10, 300, [RankStatus(0, 11, None, False, None), RankStatus(1, 12, None, False, 4)]))
    assert "no collective yet (start-up limit 300s)" in line and "idle 10s of 300s" not in line
    assert "rank 0: starting" in line and "rank 1: initialized" in line


def test_after_the_first_collective_the_status_names_the_hang_timeout():
    a, = ranks(1)
    a.coll("all_reduce", (4,))
    line = status_line(RunStatus(30, 12, 60, [RankStatus(0, 11, a.events[-1], True, 12)]))
    assert "idle 12s of 60s" in line and "all_reduce #1" in line


def test_a_busy_silence_says_busy_not_idle_of_the_timeout():
    a, = ranks(1)
    a.coll("barrier", ())
    busy = "busy: rank 0 working in save (train.py:88) (progressing: 3.2 s CPU), while rank 1 waits in barrier"
    line = status_line(RunStatus(300, 240, 60, [RankStatus(0, 11, a.events[-1], True, 240)], busy=busy))
    assert f"silent 240s, {busy}" in line and "idle 240s of 60s" not in line


def test_the_phase_other_reads_outside_forward_backward():
    a, = ranks(1)
    a.coll("all_reduce", (4,))  # Phase.OTHER: issued outside forward, backward, optimizer and checkpoint
    assert a.events[-1].phase.value == "other"  # the trace's and the report's value, a schema, stays
    line = status_line(RunStatus(30, 12, 60, [RankStatus(0, 11, a.events[-1], True, 12)]))
    assert "done, outside forward/backward, step 0" in line and ", other," not in line
