"""The supervisors' exchange through the rendezvous store (``runner/exchange.py``), over an in-memory
store with TCPStore's operations: two nodes, one rank each, find the desync of the recorded traces
together (neither sees it alone), and a healthy pair finds none."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from moedoctor.runner.exchange import Exchange, Mailboxes, desync_from_json, desync_to_json, store_of
from moedoctor.runner.online import DesyncDetector
from moedoctor.runner.progress import ProgressTracker

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


class FakeStore:
    """TCPStore's add/set/get/check/delete_key, in memory, thread-safe; get waits like TCPStore's."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def add(self, key, n):
        with self.cond:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def set(self, key, value):
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=5):
                raise TimeoutError(key)
            return self.data[key]

    def check(self, keys):
        with self.cond:
            return all(k in self.data for k in keys)

    def delete_key(self, key):
        with self.cond:
            return self.data.pop(key, None) is not None


def two_nodes(name: str, store: FakeStore) -> tuple[list[Exchange], DesyncDetector]:
    nodes = [Exchange("h", 1, "job", period=0.05, connect=lambda h, p: store).start() for _ in range(2)]
    ref = DesyncDetector()

    def listener(rank, items, restarted):
        ref.feed(rank, items, restarted)
        nodes[rank].feed(rank, items, restarted)  # node N runs rank N

    ProgressTracker(GOLDEN / name / "traces", listener=listener).poll()
    return nodes, ref


def test_two_nodes_find_the_desync_through_the_store():
    store = FakeStore()
    nodes, ref = two_nodes("inflight_metric_allreduce", store)
    try:
        deadline = time.monotonic() + 20
        while any(n.desync is None for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ref.desync is not None
        for n in nodes:
            assert n.problem is None and n.desync is not None
            found, expected = n.desync, ref.desync
            assert (found.group, found.seq, found.ranks) == (expected.group, expected.seq, expected.ranks)
        assert sorted(n.node for n in nodes) == [0, 1]
        # Messages are deleted as they are read: the store holds the counters, the finding and what is in flight.
        in_flight = [k for k in store.data if not k.endswith(("/n", "/nodes", "/desync"))]
        assert len(in_flight) <= 4 and "moedoctor/job/desync" in store.data, sorted(store.data)
    finally:
        for n in nodes:
            n.close()


def test_a_healthy_pair_finds_nothing():
    store = FakeStore()
    nodes, ref = two_nodes("healthy", store)
    try:
        time.sleep(2.0)  # rounds past the coordinator's settle time
        assert ref.desync is None and all(n.desync is None and n.problem is None for n in nodes)
        assert all(n.bytes_sent > 0 for n in nodes)
    finally:
        for n in nodes:
            n.close()


def test_a_desync_found_by_one_node_reaches_the_other():
    store = FakeStore()
    nodes, ref = two_nodes("inflight_metric_allreduce", store)
    try:
        boxes = Mailboxes(store, "job")
        deadline = time.monotonic() + 20
        while boxes.desync() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert boxes.desync() == nodes[0].desync or nodes[0].desync is None
    finally:
        for n in nodes:
            n.close()
    assert desync_from_json(desync_to_json(ref.desync)) == ref.desync


@pytest.mark.parametrize("command, expected", [
    ("torchrun --nnodes 2 --node_rank 1 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:2955 --rdzv-id j t.py",
     ("10.0.0.1", 2955, "j")),
    ("torchrun --nnodes=1:4 --rdzv_backend=c10d --rdzv_endpoint=head --rdzv_id=j t.py", ("head", 29400, "j")),
    ("torchrun --nnodes 2 --node_rank 0 --master_addr head --master_port 1234 t.py", ("head", 1234, "none")),
    ("torchrun --standalone --nproc_per_node 2 t.py", None),
    ("torchrun --nproc_per_node 2 t.py", None),
    ("torchrun --nnodes 2 --rdzv_backend etcd --rdzv_endpoint h:1 t.py", None),
])
def test_the_rendezvous_store_of_a_command(command, expected):
    assert store_of(command.split()) == expected


def test_a_desync_published_right_before_close_still_reaches_the_store():
    store = FakeStore()
    ref = DesyncDetector()
    ProgressTracker(GOLDEN / "inflight_metric_allreduce" / "traces", listener=ref.feed).poll()
    node = Exchange("h", 1, "job", period=0.05, connect=lambda h, p: store).start()
    deadline = time.monotonic() + 10
    while node.node is None and time.monotonic() < deadline:
        time.sleep(0.01)
    node.publish(ref.desync)
    node.close()
    assert Mailboxes(store, "job").desync() == ref.desync


def test_lags_are_taken_once():
    from moedoctor.runner.online import Lag

    node = Exchange("h", 1, "job")  # not started: no store needed
    lag = Lag("0", 5, 2, (0,), 1, 3, 1, 0.0)
    node.lags.append(lag)
    assert node.take_lags() == [lag] and node.take_lags() == []
    node.lags.append(lag)
    assert node.take_lags() == [lag]


def test_nodes_without_a_shared_directory_judge_a_straggler_together():
    """Busy is not stuck across nodes: node 0's rank waits in the all-reduce, node 1's rank sits in
    its data loader with no progress. Neither node can prove the hang from its own rank alone; with
    the other node's judged states (through the store) both can."""
    from moedoctor.rank_states import Pending, RankEvidence, RankState, judge

    store = FakeStore()
    nodes = [Exchange("h", 1, "job", period=0.05, connect=lambda h, p: store).start() for _ in range(2)]
    try:
        waiting = RankEvidence(0, pending=Pending("0", 3, "all_reduce", (0, 1), "ddp.py:15"), completion_tracked=True,
                               stack_read=True, quiet_s=30.0)
        stalled = RankEvidence(1, stack_read=True, where="_read_shard (train.py:44)", quiet_s=30.0)
        assert judge([waiting], 20.0, 30.0, world=range(2)).kind.value == "unproven"  # node 0 alone
        nodes[0].local_states = {0: waiting.to_dict(20.0)}
        nodes[1].local_states = {1: stalled.to_dict(20.0)}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (1 in nodes[0].remote and 0 in nodes[1].remote):
            time.sleep(0.05)
        published, doc = nodes[0].remote[1]
        remote = RankEvidence.from_dict(1, doc, age=time.time() - published)
        assert remote.state(20.0) == RankState.WORKING and remote.quiet_s >= 30.0
        j = judge([waiting, remote], 20.0, 30.0, world=range(2))
        assert j.proven and "rank 1 outside any collective in _read_shard (train.py:44)" in j.line
        _, doc = nodes[1].remote[0]
        assert judge([stalled, RankEvidence.from_dict(0, doc)], 20.0, 30.0, world=range(2)).proven
    finally:
        for n in nodes:
            n.close()
