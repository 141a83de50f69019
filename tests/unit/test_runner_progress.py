"""The watchdog's view of growing trace files, and the coverage check built from it."""

from __future__ import annotations

from moedoctor.runner.manifest import coverage_check
from moedoctor.runner.progress import ProgressTracker
from moedoctor.trace import format as fmt

from test_trace_reader import BASE, collective, header


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def append(path, *records, raw: bytes = b""):
    with open(path, "ab") as f:
        f.write(b"".join(fmt.encode(r) for r in records) + raw)


def test_follows_appended_records_and_half_written_lines(tmp_path):
    clock = Clock()
    tracker = ProgressTracker(tmp_path, clock)
    assert tracker.poll() == {} and tracker.last_progress() is None
    path = tmp_path / fmt.trace_file_name(1)
    path.write_bytes(fmt.encode(header(1))[:20])  # header still being written
    assert tracker.poll() == {}
    path.write_bytes(fmt.encode(header(1)))
    append(path, *BASE, collective(0, 1))
    state = tracker.poll()[1]
    assert (state.last.op, state.last.seq, state.issued, state.last_completed) == ("all_reduce", 1, 1, False)
    assert state.pid == 101 and state.last_progress == 100.0

    clock.now = 105.0
    line = fmt.encode(collective(1, 2, op="broadcast"))
    append(path, raw=line[:10])  # half a record: no progress yet
    assert tracker.poll()[1].last.seq == 1 and tracker.last_progress() == 100.0
    append(path, raw=line[10:])
    assert tracker.poll()[1].last.op == "broadcast" and tracker.last_progress() == 105.0

    clock.now = 110.0
    append(path, {"k": "e", "t": 3.0, "kind": "grad_norm", "step": 1})  # evidence is not progress
    assert tracker.poll()[1].last_progress == 105.0
    append(path, {"k": "d", "i": 1, "t": 9.0})
    state = tracker.poll()[1]
    assert state.last_completed and state.last_progress == 110.0


def test_a_rewritten_trace_starts_over(tmp_path):
    tracker = ProgressTracker(tmp_path, Clock())
    path = tmp_path / fmt.trace_file_name(0)
    path.write_bytes(fmt.encode(header(0)))
    append(path, *BASE, collective(0, 1), collective(1, 2), collective(2, 3))
    assert tracker.poll()[0].issued == 3
    path.write_bytes(fmt.encode(header(0, pid=999)))  # a restarted rank truncates its file
    append(path, *BASE, collective(0, 1))
    state = tracker.poll()[0]
    assert state.pid == 999 and state.issued == 1


def test_rejects_foreign_files_once(tmp_path):
    tracker = ProgressTracker(tmp_path, Clock())
    (tmp_path / fmt.trace_file_name(0)).write_text('{"format": "other"}\n')
    tracker.poll()
    tracker.poll()
    assert len(tracker.problems) == 1 and "not a moedoctor trace" in tracker.problems[0]


def test_coverage_check_reports_gaps_and_silent_ranks(tmp_path):
    tracker = ProgressTracker(tmp_path, Clock())
    for rank, groups in ((0, [["0", 3, 3]]), (1, [["0", 2, 3], ["1", 1, None]])):
        path = tmp_path / fmt.trace_file_name(rank)
        path.write_bytes(fmt.encode(header(rank)))
        append(path, *BASE, {"k": "v", "t": 4.0, "reason": "exit", "groups": groups, "dropped": 0})
    ranks = tracker.poll()
    assert coverage_check({0: ranks[0]}, 1).complete
    check = coverage_check(ranks, 3)
    assert not check.complete
    assert {"rank": 1, "group": "0", "recorded": 2, "backend": 3, "gap": 1} in check.gaps
    assert {"rank": 2, "problem": "no trace"} in check.gaps
    assert len(check.gaps) == 2
