"""The digest layer (runner/digest.py) finds what ``DesyncDetector`` finds, on factory-built streams."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from event_factory import ranks

from moedoctor.events import Group, Phase
from moedoctor.runner.digest import Coordinator, LocalDigest, NodeDigest, coordinator_of
from moedoctor.runner.online import DesyncDetector
from moedoctor.runner.progress import ProgressTracker

PAIR_A = Group("1", "pair_a", (0, 1))
PAIR_B = Group("2", "pair_b", (2, 3))


def both(builders, block: int = 4, polls: int = 3):
    """The reference detector and the digest layer on the same streams (each rank's whole stream,
    ranks in order), polled past the settle time."""
    ref = DesyncDetector()
    dig = LocalDigest(block=block, settle=0.5)
    for b in builders:
        ref.feed(b.rank, b.events)
        dig.feed(b.rank, b.events)
    for i in range(polls):
        dig.poll(float(i))
    return ref, dig


def same(ref, dig):
    a, b = ref.desync, dig.desync
    assert a is not None and b is not None
    assert (a.group, a.seq, a.ranks, a.ops, a.classes, a.reason, a.issued_at) == (
        b.group, b.seq, b.ranks, b.ops, b.classes, b.reason, b.issued_at)
    return b


def test_mismatch_mid_block_found_when_the_block_closes():
    bs = ranks(4)
    for i in range(23):
        for b in bs:
            op = "broadcast" if (i == 9 and b.rank == 2) else "all_reduce"
            b.coll(op, (8,), step=i // 4)
    ref, dig = both(bs)
    d = same(ref, dig)
    assert d.seq == 10 and d.ops[2] == "broadcast"
    assert dig.coordinator.expanded == 1  # only the block holding seq 10


def test_frontier_mismatch_found_without_a_full_block():
    # Both ranks stop right after the mismatch (a hang): seq 6 of blocks of 4 never closes.
    a, b = ranks(2)
    for i in range(5):
        a.coll("all_gather", (16,), step=i)
        b.coll("all_gather", (16,), step=i)
    a.coll("all_reduce", (1,), phase=Phase.OPTIMIZER, done=False)
    b.coll("all_gather", (16,), done=False)
    ref, dig = both([a, b], polls=1)
    d = same(ref, dig)
    assert d.seq == 6 and d.line() == ref.desync.line()


def test_frontier_shape_mismatch_and_frontiers_apart():
    # rank 1 skips one collective and runs on by one (async): frontiers differ, then settle.
    a, b = ranks(2)
    for _ in range(5):
        a.coll("all_reduce", (4,))
        b.coll("all_reduce", (4,))
    a.coll("all_reduce", (2,))
    a.coll("all_gather", (4,), done=False)
    b.coll("all_gather", (4,), done=False)
    ref, dig = both([a, b])
    assert same(ref, dig).seq == 6


def test_missing_member_does_not_hide_a_mismatch_between_the_others():
    bs = ranks(3)[:2]  # rank 2 of the world of 3 never reports
    for b in bs:
        b.world_size = 3
    for i in range(12):
        for b in bs:
            b.coll("all_gather" if (i == 6 and b.rank == 1) else "all_reduce", (4,))
    ref, dig = both(bs)
    assert same(ref, dig).seq == 7


def test_healthy_uneven_all_to_all_never_expands():
    ep = Group("3", "ep", (0, 1, 2))
    bs = ranks(3)
    for step in range(20):
        # rank r sends (r + j + step) % 5 + 1 rows to member j; receives what each sends it
        for b in bs:
            send = tuple((b.rank + j + step) % 5 + 1 for j in range(3))
            recv = tuple((j + b.rank + step) % 5 + 1 for j in range(3))
            b.coll("all_to_all", (sum(send), 8), out_shapes=((sum(recv), 8),), group=ep, splits=(send, recv),
                   step=step)
            b.coll("all_reduce", (8,), reduce_op="sum" if b.rank else None, step=step)  # known on some only
    ref, dig = both(bs)
    assert ref.desync is None and dig.desync is None
    assert dig.coordinator.expanded == 0


def test_broken_split_contract_found_with_its_reason():
    ep = Group("3", "ep", (0, 1, 2))
    bs = ranks(3)
    for step in range(7):
        for b in bs:
            send = (2, 2, 2)
            recv = (2, 3, 2) if (step == 5 and b.rank == 0) else (2, 2, 2)  # rank 0 expects 3 from rank 1
            b.coll("all_to_all", (6, 8), out_shapes=((sum(recv), 8),), group=ep, splits=(send, recv))
    ref, dig = both(bs, polls=1)  # seq 6 is at the frontier, blocks of 4: only the frontier balance sees it
    d = same(ref, dig)
    assert d.seq == 6 and d.reason == "rank 0 expects 24 element(s) from rank 1, which sends it 16"


def test_reduce_op_known_on_both_sides_and_different():
    a, b = ranks(2)
    for i in range(8):
        a.coll("all_reduce", (4,), reduce_op="sum")
        b.coll("all_reduce", (4,), reduce_op="max" if i == 2 else None)
    ref, dig = both([a, b])
    assert same(ref, dig).seq == 3


def test_lag_from_frontiers_same_as_check_lags():
    a, b = ranks(2)
    for step in range(2):
        a.coll("all_reduce", step=step)
        b.coll("all_reduce", step=step)
    a.coll("all_reduce", step=2, done=False)
    ref = DesyncDetector(clock=lambda: 0.0)
    dig = LocalDigest(clock=lambda: 0.0)
    for x in (a, b):
        ref.feed(x.rank, x.events)
        dig.feed(x.rank, x.events)
    st = {0: SimpleNamespace(rank=0, last=a.events[-1], last_completed=False, last_progress=10.0),
          1: SimpleNamespace(rank=1, last=b.events[-1], last_completed=True, last_progress=10.0)}
    assert ref.check_lags(st, now=10.5) == [] and dig.poll(10.5, st).lags == []
    want = ref.check_lags(st, now=11.5)
    got = dig.poll(11.5, st).lags
    assert want and got == want
    assert dig.poll(12.5, st).lags == []
    assert dig.desync is None


def test_two_nodes_sharded_coordinators_over_bytes():
    # 4 ranks on 2 nodes; groups sharded over both nodes' coordinators; only bytes cross.
    bs = ranks(4)
    for i in range(10):
        for b in bs:
            group = PAIR_A if b.rank in (0, 1) else PAIR_B
            b.coll("all_reduce", (8,), group=group)
            b.coll("broadcast" if (i == 7 and b.rank == 3) else "all_gather", (16,))
    nodes = [NodeDigest(0, block=4), NodeDigest(1, block=4)]
    coords = [Coordinator(block=4), Coordinator(block=4)]
    route = coordinator_of(2, lambda r: r // 2)
    for b in bs:
        nodes[b.rank // 2].feed(b.rank, b.events)
    found = None
    for t in range(3):
        for n in nodes:
            for dest, msg in n.messages(float(t), None, route).items():
                coords[dest].receive(msg)
        for c in coords:
            out = c.poll(float(t))
            for req in out.requests:
                for node in req.nodes:
                    c.receive_records(nodes[node].answer(req.to_bytes()))
            found = found or c.poll(float(t)).desync
    ref = DesyncDetector()
    for b in bs:
        ref.feed(b.rank, b.events)
    assert found is not None and (found.group, found.seq, found.ops) == (ref.desync.group, ref.desync.seq,
                                                                         ref.desync.ops)


def test_healthy_streams_interleaved_never_flag():
    from test_online_detector import feed_interleaved, healthy

    class Polling(LocalDigest):
        """Polled after every batch the tracker would hand over."""

        t = 0.0

        def feed(self, rank, items, restarted=False):
            super().feed(rank, items, restarted)
            self.t += 0.1
            self.poll(self.t)

    bs = healthy(4, 40)
    for seed in range(5):
        dig = Polling(block=4, settle=0.5)
        feed_interleaved(dig, bs, seed)
        for _ in range(3):
            dig.t += 1.0
            dig.poll(dig.t)
        assert dig.desync is None
        assert dig.coordinator.pending() == 0


GOLDEN = Path(__file__).parents[1] / "golden"


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.iterdir() if (p / "traces").is_dir()))
def test_recorded_streams_same_findings(name):
    """Recorded traces (tests/golden), read by the tracker as ``moedoctor run`` reads them, both ways."""
    ref = DesyncDetector()
    dig = LocalDigest(block=8, settle=0.0)

    def listener(rank, items, restarted):
        ref.feed(rank, items, restarted)
        dig.feed(rank, items, restarted)

    tracker = ProgressTracker(GOLDEN / name / "traces", listener=listener)
    states = tracker.poll()
    assert ref.records > 0
    for i in range(3):
        dig.poll(float(i), states)
    if ref.desync is None:
        assert dig.desync is None
    else:
        same(ref, dig)


def _scale_benchmark():
    import importlib.util

    path = Path(__file__).parents[2] / "benchmarks" / "online_scale.py"
    spec = importlib.util.spec_from_file_location("online_scale", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("plant", ["extra", "split", "hang"])
def test_scale_benchmark_finds_the_planted_desync_at_64_ranks(plant):
    """benchmarks/online_scale.py at its smallest size (8 nodes, groups chunked at 4 members so the
    chunk-and-root path runs): the planted rank and group are found, nothing else is expanded."""
    bench = _scale_benchmark()
    bench.FANIN = 4
    res = bench.simulate(64, 2.5, 0.5, plant, quiet=True)
    d = res["found"]
    assert d is not None and res["victim"] in d.ranks
    assert res["victim"] in d.group_ranks
    if plant in ("extra", "hang"):
        assert d.group.startswith("fsdp") and "all_reduce" in d.ops[res["victim"]]
    else:
        assert d.group.startswith("ep") and d.reason and "expects" in d.reason
    assert res["expanded"] == 1 and res["unconfirmed"] == 0
    assert 0 < res["latency"] < 2.5
