"""The online desync detector of ``moedoctor run`` on factory-built events."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

from event_factory import ranks

from moedoctor.analysis.matching import op_classes
from moedoctor.events import Group, Phase
from moedoctor.runner.online import NO_PATTERN_YET, DesyncDetector
from moedoctor.runner.progress import ProgressTracker

PAIR_A = Group("1", "pair_a", (0, 1))
PAIR_B = Group("2", "pair_b", (2, 3))


def feed_interleaved(det: DesyncDetector, builders, seed: int, chunk: int = 3) -> None:
    """Every builder's events in file order, the ranks' batches interleaved at random."""
    rng = random.Random(seed)
    queues = {b.rank: list(b.events) for b in builders}
    while any(queues.values()):
        rank = rng.choice([r for r, q in queues.items() if q])
        n = rng.randint(1, chunk)
        det.feed(rank, queues[rank][:n])
        del queues[rank][:n]


def healthy(n: int = 4, steps: int = 20):
    bs = ranks(n)
    for step in range(steps):
        for b in bs:
            b.coll("all_gather", (16,), phase=Phase.FORWARD, step=step)
            group = PAIR_A if b.rank in (0, 1) else PAIR_B
            b.coll("all_reduce", (8,), group=group, step=step, reduce_op="sum" if b.rank % 2 else None)
            if b.rank in (0, 1):
                b.p2p("send" if b.rank == 0 else "recv", 1 - b.rank, (3,))
            b.coll("reduce_scatter", (4, 4), dtype="bfloat16", phase=Phase.BACKWARD, step=step)
    return bs


def test_identical_streams_never_flag_in_any_interleaving():
    bs = healthy()
    for seed in range(30):
        det = DesyncDetector()
        feed_interleaved(det, bs, seed)
        assert det.desync is None
        assert det.pending() == 0  # every seq reported by every member: nothing kept
        assert det.records == sum(len([e for e in b.events if not e.is_p2p]) for b in bs)


def test_mismatch_flagged_when_both_sides_issued():
    a, b = ranks(2)
    for step in range(3):
        a.coll("all_gather", (16,), step=step)
        b.coll("all_gather", (16,), step=step)
    a.coll("all_reduce", (1,), phase=Phase.OPTIMIZER, step=3, done=False)   # seq 4
    b.coll("all_gather", (16,), phase=Phase.FORWARD, step=4, done=False)    # seq 4
    det = DesyncDetector(clock=lambda: b.time + 0.25)
    det.feed(0, a.events)
    assert det.desync is None  # only one side so far: nothing to compare
    det.feed(1, b.events[:3])
    assert det.desync is None
    det.feed(1, b.events[3:])
    d = det.desync
    assert d is not None and (d.group, d.seq, d.ranks) == ("0", 4, (0, 1))
    assert d.ops == {0: "all_reduce", 1: "all_gather"}
    assert d.line() == (
        "group 0 (default_pg) #4, rank 0 all_reduce vs rank 1 all_gather "
        f"(mechanism different-op; {NO_PATTERN_YET})"
    )
    assert d.issued_at == max(a.events[3].time, b.events[3].time)
    assert abs(d.latency - 0.25) < 1e-9
    assert d.classes == op_classes({0: a.events[3], 1: b.events[3]})


def test_the_same_op_from_two_call_sites_is_a_different_op_as_offline():
    """Offline, a different shape is the same op from the same call site; the same op from two call
    sites is two collectives. The first report follows that definition."""
    a, b = ranks(2)
    a.coll("all_reduce", (4,), line=20, done=False)
    b.coll("all_reduce", (2,), line=31, done=False)
    det = DesyncDetector()
    det.feed(0, a.events)
    det.feed(1, b.events)
    assert det.desync is not None and det.desync.mechanism == "different-op", det.desync


def test_shape_and_dtype_mismatch_show_details():
    a, b = ranks(2)
    a.coll("all_reduce", (4,))
    b.coll("all_reduce", (2,))
    det = DesyncDetector()
    det.feed(1, b.events)
    det.feed(0, a.events)
    assert det.desync.line() == (
        "group 0 (default_pg) #1, rank 0 all_reduce[4] float32 vs rank 1 all_reduce[2] float32 "
        f"(mechanism different-shape; {NO_PATTERN_YET})"
    )
    a, b = ranks(2)
    a.coll("all_reduce", (4,), dtype="float32")
    b.coll("all_reduce", (4,), dtype="bfloat16")
    det = DesyncDetector()
    det.feed(0, a.events)
    det.feed(1, b.events)
    assert det.desync is not None


def test_reduce_op_same_notion_as_the_analyzer():
    # Known on one side only: the same collective (the analyzer's op_classes agrees).
    a, b, c = ranks(3)
    a.coll("all_reduce", reduce_op=None)
    b.coll("all_reduce", reduce_op="sum")
    c.coll("all_reduce", reduce_op="sum")
    det = DesyncDetector()
    for x in (a, b, c):
        det.feed(x.rank, x.events)
    assert det.desync is None
    # Known on both and different: a mismatch, as op_classes says.
    a, b, c = ranks(3)
    a.coll("all_reduce", reduce_op=None)
    b.coll("all_reduce", reduce_op="sum")
    c.coll("all_reduce", reduce_op="max")
    assert len(op_classes({0: a.events[0], 1: b.events[0], 2: c.events[0]})) > 1
    det = DesyncDetector()
    for x in (a, b, c):
        det.feed(x.rank, x.events)
    assert det.desync is not None and det.desync.seq == 1


def test_only_members_disagreeing_in_one_group_flag_it():
    bs = ranks(4)
    for b in bs:
        group = PAIR_A if b.rank in (0, 1) else PAIR_B
        b.coll("all_reduce", (8,), group=group)
        b.coll("all_reduce" if b.rank != 3 else "broadcast", (8,), group=group)  # pair_b desyncs at #2
        b.coll("all_gather", (16,))
    det = DesyncDetector()
    feed_interleaved(det, bs, 1)
    assert det.desync is not None and (det.desync.group, det.desync.seq) == ("2", 2)
    assert det.desync.ops == {2: "all_reduce", 3: "broadcast"}


def test_p2p_is_not_compared():
    a, b = ranks(2)
    a.p2p("send", 1, (3,))
    b.p2p("send", 0, (5,))  # a batch's order may differ across a pair: never an online alarm
    a.coll("all_reduce")
    b.coll("all_reduce")
    det = DesyncDetector()
    det.feed(0, a.events)
    det.feed(1, b.events)
    assert det.desync is None and det.records == 2


def test_memory_bounded_by_lag():
    a, b = ranks(2)
    for _ in range(5000):
        a.coll("all_reduce")
        b.coll("all_reduce")
    det = DesyncDetector()
    for i in range(0, 5000, 100):  # rank 1 trails rank 0 by 100 collectives
        det.feed(0, a.events[i:i + 100])
        assert det.pending() <= 100
        det.feed(1, b.events[i:i + 100])
        assert det.pending() == 0
    # A member that never reports: the cap holds.
    det = DesyncDetector(max_pending=1000)
    det.feed(0, a.events)
    assert det.pending() == 1000 and det.dropped == 4000


def test_restart_resets_the_rank():
    a, b = ranks(2)
    for _ in range(10):
        a.coll("all_reduce")
    for _ in range(8):
        b.coll("all_reduce")
    det = DesyncDetector()
    det.feed(0, a.events)
    det.feed(1, b.events)
    assert det.pending() == 2
    # Both restart (elastic): seq 1 again, with other ops; no alarm against the old processes.
    a2, b2 = ranks(2)
    for x in (a2, b2):
        x.coll("broadcast", (2,))
        x.coll("all_gather", (6,))
    det.feed(0, a2.events, restarted=True)
    det.feed(1, b2.events, restarted=True)
    assert det.desync is None


def state(rank, event, completed=False, progress=0.0):
    return SimpleNamespace(rank=rank, last=event, last_completed=completed, last_progress=progress)


def test_lag_found_once_when_a_member_is_a_step_behind():
    a, b = ranks(2)
    for step in range(2):
        a.coll("all_reduce", step=step)
        b.coll("all_reduce", step=step)
    a.coll("all_reduce", step=2, done=False)  # rank 0 waits at #3 (step 2); rank 1 still at step 1
    det = DesyncDetector(clock=lambda: 0.0)
    det.feed(0, a.events)
    det.feed(1, b.events)
    ranks_state = {0: state(0, a.events[-1], progress=10.0), 1: state(1, b.events[-1], True, progress=10.0)}
    assert det.check_lags(ranks_state, now=10.5) == []  # not waiting long enough yet
    lags = det.check_lags(ranks_state, now=11.5)
    assert [(x.group, x.seq, x.rank, x.rank_seq, x.rank_step, x.waiting) for x in lags] == [("0", 3, 1, 2, 1, (0,))]
    assert "rank 1 lags on group 0" in lags[0].line()
    assert det.check_lags(ranks_state, now=12.5) == []  # reported once
    assert det.desync is None


def test_no_lag_for_a_member_in_the_same_step():
    a, b = ranks(2)
    a.coll("all_reduce", step=2)
    a.coll("all_reduce", step=2, done=False)
    b.coll("all_reduce", step=2)  # behind by a collective, same step: not a whole step
    det = DesyncDetector()
    det.feed(0, a.events)
    det.feed(1, b.events)
    assert det.check_lags({0: state(0, a.events[-1]), 1: state(1, b.events[-1], True)}, now=5.0) == []


def test_tracker_feeds_each_record_once(tmp_path):
    from event_factory import write_traces

    a, b = ranks(2)
    for i in range(50):
        a.coll("all_reduce", step=i)
        b.coll("all_reduce", step=i)
    b.coll("broadcast")
    a.coll("all_reduce")
    write_traces(tmp_path, a, b)
    det = DesyncDetector()
    tracker = ProgressTracker(tmp_path, listener=det.feed)
    tracker.poll()
    tracker.poll()
    assert det.records == 102
    assert det.desync is not None and det.desync.seq == 51


def test_all_interleavings_of_a_small_desync_find_the_same_seq():
    a, b = ranks(2)
    for op_a, op_b in [("all_reduce", "all_reduce"), ("all_gather", "all_gather"), ("all_reduce", "all_gather")]:
        a.coll(op_a)
        b.coll(op_b)
    found = set()
    for order in itertools.permutations([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]):
        if [i for r, i in order if r == 0] != [0, 1, 2] or [i for r, i in order if r == 1] != [0, 1, 2]:
            continue
        det = DesyncDetector()
        for r, i in order:
            det.feed(r, [(a, b)[r].events[i]])
        found.add((det.desync.seq, det.desync.ranks))
    assert found == {(3, (0, 1))}
