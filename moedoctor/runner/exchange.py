"""Nodes without a shared file system: the supervisors of one multi-node job exchange what online
detection needs through the job's own rendezvous store (torch's ``TCPStore`` at torchrun's
``--rdzv-endpoint``, or ``--master-addr:--master-port`` with the static rendezvous).

Each node's supervisor condenses its own ranks' streams with the digest layer (``digest.NodeDigest``)
and sends its digest every period to the coordinator (the first supervisor to connect), which
compares them (``digest.Coordinator``), asks the nodes for the records of the ranges that disagree,
and judges them with the analyzer's own equality. A desync found is published under the job's key;
every supervisor polls it, so each one diagnoses and stops its own ranks.

Transport: per-node mailboxes in the store. ``moedoctor/<rdzv id>/box/<node>/n`` counts the messages
sent to a node (``add``), ``.../box/<node>/<i>`` holds message ``i``; the receiver reads and deletes
them in order, so the store holds only what is in flight. ``moedoctor/<rdzv id>/desync`` is the
finding (JSON), ``.../nodes`` numbers the supervisors as they connect. torch's own keys never start
with ``moedoctor/``.

torch is imported here only, and only when a multi-node run connects: ``moedoctor run`` on one node
never loads it. Nothing here may harm the job: a store that cannot be reached (not up yet, gone
with the agent that hosted it) is retried or given up, quietly; the job is never stopped by it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from moedoctor.runner.command import is_torchrun
from moedoctor.runner.digest import Coordinator, NodeDigest
from moedoctor.runner.online import Desync, Lag

#: Seconds between two digests of a node.
PERIOD = 0.5
#: Seconds a store operation may block (the store is local to the job's network).
STORE_TIMEOUT = 10.0


def _option(command: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in a torchrun command line (``--x v`` or ``--x=v``)."""
    for i, arg in enumerate(command):
        for name in names:
            if arg == name and i + 1 < len(command):
                return command[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def store_of(command: list[str]) -> tuple[str, int, str] | None:
    """``(host, port, job key)`` of a multi-node torchrun command's rendezvous store, or None: a
    single-node command (``--nnodes`` 1, ``--standalone``), a rendezvous without a TCPStore (etcd), or a
    command that is not torchrun (its options, such as a script's own ``--nnodes``, say nothing of a store)."""
    if not is_torchrun(command):
        return None
    nnodes = _option(command, "--nnodes")
    if nnodes is None or "--standalone" in command:
        return None
    try:
        if max(int(n) for n in nnodes.split(":")) < 2:
            return None
    except ValueError:
        return None
    backend = _option(command, "--rdzv-backend", "--rdzv_backend") or "static"
    key = _option(command, "--rdzv-id", "--rdzv_id") or "none"
    if backend == "c10d":
        endpoint = _option(command, "--rdzv-endpoint", "--rdzv_endpoint")
        default = 29400
    elif backend == "static":
        addr = _option(command, "--master-addr", "--master_addr") or "127.0.0.1"
        endpoint, default = f"{addr}:{_option(command, '--master-port', '--master_port') or 29500}", 29500
    else:
        return None
    if not endpoint:
        return None
    host, _, port = endpoint.rpartition(":") if endpoint.count(":") == 1 or "]" in endpoint else (endpoint, "", "")
    try:
        return (host.strip("[]") or "127.0.0.1", int(port) if port else default, key)
    except ValueError:
        return None


def desync_to_json(d: Desync) -> str:
    doc = asdict(d)
    doc["ops"] = {str(r): op for r, op in d.ops.items()}
    return json.dumps(doc)


def desync_from_json(text: str | bytes) -> Desync:
    doc = json.loads(text)
    return Desync(
        group=doc["group"],
        group_desc=doc["group_desc"],
        group_ranks=tuple(doc["group_ranks"]),
        seq=doc["seq"],
        ops={int(r): op for r, op in doc["ops"].items()},
        classes=[tuple(c) for c in doc["classes"]],
        ranks=(doc["ranks"][0], doc["ranks"][1]),
        issued_at=doc["issued_at"],
        detected_at=doc["detected_at"],
        reason=doc.get("reason"),
        mechanism=doc.get("mechanism"),
    )


class Mailboxes:
    """Messages between supervisors over a store with ``add``/``set``/``get``/``check``/``delete_key``
    (a ``TCPStore``, or a dict-backed fake in tests)."""

    def __init__(self, store: Any, key: str):
        self.store = store
        self.prefix = f"moedoctor/{key}/"
        self.read = 0  # messages of our box consumed

    def join(self) -> int:
        """Number this supervisor (0 for the first to connect: the coordinator)."""
        return int(self.store.add(self.prefix + "nodes", 1)) - 1

    def send(self, node: int, kind: str, sender: int, body: bytes) -> int:
        n = int(self.store.add(f"{self.prefix}box/{node}/n", 1))
        self.store.set(f"{self.prefix}box/{node}/{n}", json.dumps([kind, sender]).encode() + b"\n" + body)
        return len(body)

    def receive(self, node: int) -> list[tuple[str, int, bytes]]:
        count = int(self.store.add(f"{self.prefix}box/{node}/n", 0))
        out = []
        while self.read < count:
            key = f"{self.prefix}box/{node}/{self.read + 1}"
            raw = bytes(self.store.get(key))  # waits for a message counted but not set yet
            self.store.delete_key(key)
            self.read += 1
            head, _, body = raw.partition(b"\n")
            kind, sender = json.loads(head)
            out.append((kind, sender, body))
        return out

    def publish_states(self, node: int, doc: dict) -> None:
        """This node's ranks as it judges them while the collectives are silent (busy is not stuck)."""
        self.store.set(f"{self.prefix}states/{node}", json.dumps(doc).encode())

    def states(self, but: int) -> dict[int, dict]:
        """Every other node's last published states, by node number."""
        count = int(self.store.add(self.prefix + "nodes", 0))
        out = {}
        for node in range(count):
            key = f"{self.prefix}states/{node}"
            if node != but and self.store.check([key]):
                out[node] = json.loads(bytes(self.store.get(key)))
        return out

    def publish_desync(self, d: Desync) -> None:
        if not self.store.check([self.prefix + "desync"]):
            self.store.set(self.prefix + "desync", desync_to_json(d).encode())

    def desync(self) -> Desync | None:
        if not self.store.check([self.prefix + "desync"]):
            return None
        return desync_from_json(bytes(self.store.get(self.prefix + "desync")))


class Exchange:
    """One supervisor's side: ``feed`` (the tracker's listener, local ranks only) from the watchdog's
    thread; a thread of its own connects, sends digests, answers requests, coordinates (node 0) and
    polls for a published desync, kept in ``desync``. ``publish(desync)``: a desync this node found
    by itself, told to the others. ``problem``: why the exchange stopped, if it did."""

    def __init__(self, host: str, port: int, key: str, period: float = PERIOD, connect: Any = None):
        self.host, self.port, self.key = host, port, key
        self.period = period
        #: {rank: RankProgress} of the local ranks (for lags), replaced whole by the watchdog's thread
        self.progress: Mapping[int, Any] | None = None
        #: Busy is not stuck: {rank: RankEvidence.to_dict()} of the local ranks while the collectives are
        #: silent (set by the watchdog's thread), published; the other nodes' ranks, read back with the
        #: Unix time each was published: ``remote`` {rank: (time, doc)}.
        self.local_states: Mapping[int, dict] | None = None
        self.remote: dict[int, tuple[float, dict]] = {}
        self._connect = connect or self._tcp_store
        self.node: int | None = None
        self.digest: NodeDigest | None = None
        self.coordinator: Coordinator | None = None
        self.desync: Desync | None = None
        self.lags: list[Lag] = []
        self._lags_taken = 0
        self.problem: str | None = None
        self.bytes_sent = 0
        self._backlog: list[tuple[int, list, bool]] = []  # fed before the node had its number
        self._own: Desync | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="moedoctor-exchange")

    def start(self) -> "Exchange":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 1)

    def feed(self, rank: int, items: list, restarted: bool = False) -> None:
        with self._lock:
            if self.digest is None:
                self._backlog.append((rank, items, restarted))
            else:
                self.digest.feed(rank, items, restarted)

    def publish(self, desync: Desync) -> None:
        self._own = desync

    def take_lags(self) -> list[Lag]:
        """The lags the coordinator (this node, node 0) found since the last call."""
        taken = self.lags[self._lags_taken :]
        self._lags_taken += len(taken)
        return taken

    # -- the thread ------------------------------------------------------------------------------

    @staticmethod
    def _tcp_store(host: str, port: int) -> Any:
        # torch's C++ warnings (a store gone with the agent that hosted it) are not the user's business.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        import torch.distributed as dist  # only here: a multi-node run's supervisor

        return dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT), wait_for_workers=False
        )

    def _loop(self) -> None:
        boxes = None
        while not self._stop.is_set():
            try:
                if boxes is None:
                    boxes = Mailboxes(self._connect(self.host, self.port), self.key)
                    node = boxes.join()
                    with self._lock:
                        self.digest = NodeDigest(node)
                        for args in self._backlog:
                            self.digest.feed(*args)
                        self._backlog = []
                    self.node = node
                    if node == 0:
                        self.coordinator = Coordinator()
                self._round(boxes)
            except Exception as e:  # noqa: BLE001 - the store is not up yet, or gone: never the job's trouble
                if boxes is None:
                    self._stop.wait(1.0)  # the agent hosting the store has not started it yet
                    continue
                self.problem = f"the rendezvous store at {self.host}:{self.port} stopped answering ({e!r:.200})"
                return
            self._stop.wait(self.period)
        if boxes is not None and self._own is not None:  # closed right after publish(): tell the others
            try:
                boxes.publish_desync(self._own)
            except Exception:  # noqa: BLE001 - the store is gone: the other nodes time out by themselves
                pass

    def _round(self, boxes: Mailboxes) -> None:
        assert self.digest is not None and self.node is not None
        now = time.monotonic()
        progress = self.progress
        with self._lock:
            message = self.digest.message(now, progress)
        self.bytes_sent += boxes.send(0, "digest", self.node, message)
        for kind, sender, body in boxes.receive(self.node):
            if kind == "digest" and self.coordinator is not None:
                self.coordinator.receive(body, time.monotonic())
            elif kind == "request":
                with self._lock:
                    answer = self.digest.answer(body)
                self.bytes_sent += boxes.send(sender, "answer", self.node, answer)
            elif kind == "answer" and self.coordinator is not None:
                self.coordinator.receive_records(body)
        if self.coordinator is not None and self.desync is None:
            out = self.coordinator.poll(time.monotonic())
            self.lags.extend(out.lags)
            for req in out.requests:
                for node in req.nodes:
                    self.bytes_sent += boxes.send(node, "request", self.node, req.to_bytes())
            if out.desync is not None:
                boxes.publish_desync(out.desync)
        if self._own is not None:
            boxes.publish_desync(self._own)
            self._own = None
        states = self.local_states
        if states is not None:
            boxes.publish_states(self.node, {"t": time.time(), "ranks": {str(r): d for r, d in states.items()}})
            remote = {}
            for doc in boxes.states(but=self.node).values():
                for rank, state in (doc.get("ranks") or {}).items():
                    remote[int(rank)] = (float(doc.get("t") or 0.0), state)
            self.remote = remote
        if self.desync is None:
            self.desync = boxes.desync()
