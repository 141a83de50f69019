"""Online detection that scales: each node condenses its own ranks' streams into small digests, a
coordinator compares digests, and only the ranges whose digests disagree are expanded into records.

No process reads every rank's stream. Findings are the ``Desync`` / ``Lag`` of ``online.py``, decided
by the same code: an expanded range is fed to a fresh ``DesyncDetector`` (``op_classes`` and the
pairwise contract), and lags are ``check_lags``'s rule applied to the ranks' frontiers.

What a node digests, per local rank and group (groups of two or more members; p2p ops are skipped as
``DesyncDetector`` skips them): its frontier seq; for every block of ``block`` seqs ((k*B, (k+1)*B])
a chain hash of the ops' classes (``signature()`` and the reduce op, hashed with a process-independent
64-bit mix), and the running chain of the block the frontier is in (the "prefix"). Variable-size
collectives (``CONTRACT_OPS``) have their sizes outside ``signature()``; their contract is digested as
a *balance*: each member adds ``h(seq, sender, receiver, n)`` for every element count it sends and
subtracts it for every count it expects, so over a group the balances of a seq sum to 0 exactly when
every pair agrees (uneven splits that pair up cancel; any broken pair leaves a non-zero sum, a
false zero has probability 2**-64). A side whose sizes are unknown (symbolic, capped) counts in
``unknown``: its block is expanded rather than trusted, and the exact check claims nothing.

The coordinator compares, per group: complete blocks among the members that reported them (as
``DesyncDetector`` compares members as they report; a block is dropped once every member reported it,
after its summed balance is checked); the prefixes of members at the same frontier (a hang right after
a mismatch, before any block closes: all members stop at the same seq); and when a group's frontiers
differ and have not moved for ``settle`` seconds, the span from the lowest frontier's block to the
highest frontier (capped at 4 blocks). A disagreement becomes an ``Expansion`` (group, seq range,
ranks, the nodes to ask); the nodes answer with their records of that range, and the range is
judged exactly. A disagreement the exact check does not confirm (a reduce op known on one side only,
an unknown size) is dropped: no alarm without the analyzer's own verdict.

The interface (everything crosses nodes as ``bytes``; the transport is the caller's):

- Node: ``node = NodeDigest(node_id)``; ``node.feed(rank, items, restarted=False)`` is a
  ``ProgressTracker`` listener (``ProgressTracker(dir, listener=node.feed)``, as ``DesyncDetector``);
  every exchange period ``node.message(now, progress)`` -> ``bytes`` (``progress``: the tracker's
  ``ranks`` mapping, for lags; ``now`` on the tracker's monotonic clock), or
  ``node.messages(now, progress, route)`` -> ``{coordinator_node: bytes}`` where ``route(group_name,
  group_ranks, rank) -> node`` shards the groups over coordinators: ``route =
  coordinator_of(nodes, node_of_rank)`` (every node must build the same route). On a request:
  ``node.answer(request_bytes)`` -> ``bytes`` (its local ranks' records of that group and range).
- Coordinator: ``coord = Coordinator(node=my_node, fanin=FANIN, route=route)`` on every node (one
  node alone: ``Coordinator()``); ``coord.receive(message_bytes, now)`` for every message addressed to
  it (nodes' digests and other coordinators' chunk summaries alike); ``out = coord.poll(now)`` ->
  ``Outcome`` with ``desync`` (a ``Desync`` or None, the first found, kept in ``coord.desync``),
  ``lags`` (new ``Lag`` s), ``requests`` (new ``Expansion`` s: send ``req.to_bytes()`` to each node
  in ``req.nodes``, hand each answer to ``coord.receive_records(response_bytes)``; the next ``poll``
  judges the range once every asked node has answered) and ``up`` (``{coordinator_node: bytes}``:
  chunk summaries, delivered like digests). A ``Desync`` found by any node's coordinator is the job's:
  broadcast it (``Desync`` is a frozen dataclass) so every node diagnoses and stops its ranks.
- One node (``moedoctor run`` on one host): ``LocalDigest`` wires one ``NodeDigest`` to one
  ``Coordinator`` with no transport; it is a drop-in for ``DesyncDetector`` (``feed``, ``poll``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moedoctor.analysis.contracts import _numel, _per_peer
from moedoctor.events import CONTRACT_OPS, P2P_OPS, CollectiveEvent, Group, Phase
from moedoctor.runner.online import LAG_IDLE, MAX_PENDING, Desync, DesyncDetector, Lag

#: Seqs per block. Small blocks: a block costs one 64-bit hash per member per group.
BLOCK = 16
#: Records kept per (local rank, group) to answer expansions.
RETAIN = 256
#: A group whose frontiers differ and have not moved for this long has its open span expanded.
SETTLE = 1.0
#: Longest span expanded at once, in blocks.
SPAN_BLOCKS = 4
#: Members of a group one coordinator compares at most; a larger group is split into chunks of this
#: many members, each compared by a chunk coordinator that sends one summary member to the root.
FANIN = 64

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: the same on every host and process (Python's ``hash`` of str is not)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _text_hash(text: str) -> int:
    h = 0
    for chunk in range(0, len(text), 7):
        h = _mix(h ^ int.from_bytes(text[chunk : chunk + 7].encode("utf-8", "replace")[:7], "little"))
    return _mix(h ^ len(text))


_RED_CODES = {"sum": 83, "avg": 65, "product": 80, "min": 109, "max": 77, "band": 97, "bor": 111, "bxor": 120}


def _red(op: str) -> int:
    """A reduce op as one byte of a block's reduce-op string ('.': not known): the reduce op is known
    on some ranks only (``CollectiveEvent.signature``), so it cannot enter the hash; position by
    position, two known codes that differ are what ``op_classes`` splits on."""
    return _RED_CODES.get(op) or 48 + _text_hash(op) % 10


def red_conflict(a: str, b: str) -> bool:
    return any(x != y and x != "." and y != "." for x, y in zip(a, b))


def red_merge(a: str, b: str) -> str:
    return "".join(y if x == "." else x for x, y in zip(a, b)) if a else b


def _reds_conflict(reds: list[str]) -> bool:
    merged = reds[0]
    for x in reds[1:]:
        if red_conflict(merged, x):
            return True
        merged = red_merge(merged, x)
    return False


def _term(seq: int, sender: int, receiver: int, n: int) -> int:
    # CPython's hash of a tuple of ints does not depend on PYTHONHASHSEED (that is str and bytes):
    # the same on every node running the same Python, and ten times cheaper than two _mix calls.
    return hash((seq, sender, receiver, n)) & _M64


def contract_terms(e: CollectiveEvent) -> tuple[int, bool]:
    """This member's share of the contract balance at its seq: (balance mod 2**64, known). Mirrors
    ``analysis.contracts``: summed over the group's members it is 0 iff no pair breaks the contract."""
    ranks = e.group.ranks
    size = len(ranks)
    seq, me = e.seq, e.rank
    bal = 0
    if e.op == "all_to_all":
        sends = _per_peer(e.in_shapes, e.in_splits, size)
        out_shapes = e.out_shapes
        if not out_shapes and e.out_splits and len(e.in_shapes) == 1 and e.in_shapes[0]:
            out_shapes = ((sum(e.out_splits),) + tuple(e.in_shapes[0][1:]),)
        recvs = _per_peer(out_shapes, e.out_splits, size)
        if sends is None or recvs is None:
            return 0, False
        for j, peer in enumerate(ranks):
            bal += _term(seq, me, peer, sends[j]) - _term(seq, peer, me, recvs[j])
        return bal & _M64, True
    root = e.root
    if root is None:
        return 0, False
    gather = e.op == "gather"
    mine = e.in_shapes if gather else e.out_shapes
    if len(mine) != 1:
        return 0, False
    n = _numel(mine[0])
    bal = _term(seq, me, root, n) if gather else -_term(seq, root, me, n)
    if me == root:
        lists = e.out_shapes if gather else e.in_shapes
        if len(lists) != size:
            return 0, False
        for j, peer in enumerate(ranks):
            if gather:
                bal -= _term(seq, peer, root, _numel(lists[j]))
            else:
                bal += _term(seq, root, peer, _numel(lists[j]))
    return bal & _M64, True


# -- the node ------------------------------------------------------------------------------------


@dataclass
class _Member:
    """One local rank's digest state on one group."""

    group: Group
    f: int = 0  # frontier: the last seq issued
    block: int = -1  # the open block's index (-1: none open)
    chain: int = 0
    bal: int = 0
    unknown: int = 0
    red: bytearray = field(default_factory=bytearray)  # per seq of the open block: reduce op code or '.'
    done: list = field(default_factory=list)  # closed blocks not yet sent: [k, chain, bal, unknown]
    kept: deque = field(default_factory=lambda: deque(maxlen=RETAIN))


class NodeDigest:
    """Condenses one node's local ranks' streams (fed by its ``ProgressTracker``)."""

    def __init__(self, node: int, block: int = BLOCK, retain: int = RETAIN):
        self.node = node
        self.block = block
        self.retain = retain
        self.records = 0
        self._members: dict[int, dict[str, _Member]] = {}
        self._epoch: dict[int, int] = {}
        self._keys: dict[tuple, int] = {}
        self._sent_groups: set[tuple[int, str]] = set()

    def feed(self, rank: int, items: list, restarted: bool = False) -> None:
        if restarted:
            self.reset_rank(rank)
        for item in items:
            if type(item) is CollectiveEvent:
                self._event(item)

    def reset_rank(self, rank: int) -> None:
        self._members.pop(rank, None)
        self._epoch[rank] = self._epoch.get(rank, 0) + 1

    def key(self, e: CollectiveEvent) -> int:
        """The 64-bit class of an op's ``signature()`` (its reduce op travels apart: see ``_red``)."""
        k = e.signature()
        h = self._keys.get(k)
        if h is None:
            h = self._keys[k] = _text_hash(repr(k))
        return h

    def _event(self, e: CollectiveEvent) -> None:
        if e.op in P2P_OPS or e.peer is not None or len(e.group.ranks) < 2:
            return
        self.records += 1
        by_group = self._members.get(e.rank)
        if by_group is None:
            by_group = self._members[e.rank] = {}
        m = by_group.get(e.group.name)
        if m is None:
            m = by_group[e.group.name] = _Member(e.group, kept=deque(maxlen=self.retain))
        seq = e.seq
        if seq <= m.f:
            return  # the same seq twice: not ours to judge (as DesyncDetector)
        m.f = seq
        m.kept.append(e)
        k = (seq - 1) // self.block
        if k != m.block:
            if m.block >= 0:
                m.done.append([m.block, m.chain, m.bal, m.unknown, m.red.decode()])  # a gap closed it early
            m.block, m.chain, m.bal, m.unknown, m.red = k, 0, 0, 0, bytearray(b"." * self.block)
        if e.reduce_op:
            m.red[(seq - 1) % self.block] = _red(e.reduce_op)
        m.chain = _mix(m.chain ^ self.key(e))
        if e.op in CONTRACT_OPS:
            bal, known = contract_terms(e)
            m.bal = (m.bal + bal) & _M64
            m.unknown += not known
        if seq % self.block == 0:
            m.done.append([k, m.chain, m.bal, m.unknown, m.red.decode()])
            m.block, m.chain, m.bal, m.unknown = -1, 0, 0, 0

    def _rank_summary(self, rank: int, state: Any, now: float) -> list | None:
        e = getattr(state, "last", None)
        if e is None:
            return None
        return [
            rank,
            e.group.name,
            e.seq,
            e.step,
            int(e.op in P2P_OPS),
            int(bool(state.last_completed)),
            round(now - state.last_progress, 3),
        ]

    def messages(
        self,
        now: float,
        progress: Mapping[int, Any] | None = None,
        route: Callable[[str, tuple, int | None], int] | None = None,
    ) -> dict[int, bytes]:
        """This period's digest, split by coordinator (``route``; all to node 0 without one)."""
        parts: dict[int, dict] = {}

        def part(dest: int) -> dict:
            p = parts.get(dest)
            if p is None:
                p = parts[dest] = {"node": self.node, "t": now, "members": [], "ranks": [], "groups": {}}
            return p

        for rank, by_group in self._members.items():
            epoch = self._epoch.get(rank, 0)
            dests = set()
            for name, m in by_group.items():
                dest = route(name, m.group.ranks, rank) if route else 0
                dests.add(dest)
                p = part(dest)
                prefix = [m.block, m.chain, m.bal, m.unknown, m.red.decode()] if m.block >= 0 else None
                p["members"].append([rank, epoch, name, m.f, prefix, m.done])
                m.done = []
                if (dest, name) not in self._sent_groups:
                    self._sent_groups.add((dest, name))
                    p["groups"][name] = [m.group.desc, pack_ranks(m.group.ranks)]
            if progress is not None and rank in progress:
                summary = self._rank_summary(rank, progress[rank], now)
                if summary is not None:
                    for dest in dests:
                        part(dest)["ranks"].append(summary)
        return {d: json.dumps(p, separators=(",", ":")).encode() for d, p in parts.items()}

    def message(self, now: float, progress: Mapping[int, Any] | None = None) -> bytes:
        """This period's whole digest as one message (one coordinator)."""
        msgs = self.messages(now, progress)
        return (
            msgs.get(0)
            or json.dumps(
                {"node": self.node, "t": now, "members": [], "ranks": [], "groups": {}}, separators=(",", ":")
            ).encode()
        )

    def answer(self, request: bytes) -> bytes:
        """The local ranks' records of the requested group and seq range."""
        req = json.loads(request)
        name, lo, hi, want = req["group"], req["lo"], req["hi"], set(req["ranks"])
        out: list[list] = []
        complete = True
        for rank, by_group in self._members.items():
            m = by_group.get(name)
            if m is None or rank not in want:
                continue
            if m.kept and m.kept[0].seq > lo and m.kept.maxlen == len(m.kept):
                complete = False  # the range's start is no longer kept
            out.extend(encode_event(e) for e in m.kept if lo <= e.seq <= hi)
        return json.dumps(
            {"id": req["id"], "node": self.node, "complete": complete, "records": out}, separators=(",", ":")
        ).encode()


def pack_ranks(ranks: tuple[int, ...]) -> list:
    """A group's ranks as runs ``[start, step, count]`` (a device mesh's groups are one run each: a
    2,048-rank group is 3 numbers, not 2,048)."""
    runs: list[list[int]] = []
    i = 0
    while i < len(ranks):
        step = ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 1
        n = 1
        while i + n < len(ranks) and ranks[i + n] - ranks[i + n - 1] == step:
            n += 1
        runs.append([ranks[i], step, n])
        i += n
    return runs


def unpack_ranks(runs: list) -> tuple[int, ...]:
    return tuple(start + step * j for start, step, n in runs for j in range(n))


def encode_event(e: CollectiveEvent) -> list:
    """What the exact comparison needs of one record."""
    return [
        e.rank,
        e.time,
        e.seq,
        e.op,
        [list(s) for s in e.in_shapes],
        [list(s) for s in e.out_shapes],
        list(e.dtypes),
        e.reduce_op,
        e.step,
        e.root,
        None if e.in_splits is None else list(e.in_splits),
        None if e.out_splits is None else list(e.out_splits),
        e.completed,
    ]


def decode_event(r: list, group: Group) -> CollectiveEvent:
    rank, t, seq, op, ins, outs, dtypes, red, step, root, isp, osp, done = r
    return CollectiveEvent(
        rank=rank,
        event_id=0,
        time=t,
        group=group,
        seq=seq,
        op=op,
        raw_op=op,
        in_shapes=tuple(tuple(s) for s in ins),
        out_shapes=tuple(tuple(s) for s in outs),
        dtypes=tuple(dtypes),
        reduce_op=red,
        async_op=False,
        thread="",
        call_site=None,
        phase=Phase.OTHER,
        step=step,
        completed=done,
        root=root,
        in_splits=None if isp is None else tuple(isp),
        out_splits=None if osp is None else tuple(osp),
    )


def coordinator_of(
    nodes: int, node_of_rank: Callable[[int], int], fanin: int | None = FANIN
) -> Callable[[str, tuple, int | None], int]:
    """A route that shards groups over the nodes: a group's coordinator (its root, ``rank`` None) is
    the node of its lowest rank shifted by a stable hash of its name, so the groups a node starts
    spread over all nodes; a member of a group of more than ``fanin`` members goes to its chunk's
    coordinator (the next nodes after the root). Give the coordinators the same ``fanin``."""
    base: dict[str, int] = {}
    index: dict[str, dict[int, int]] = {}

    def route(name: str, ranks: tuple, rank: int | None = None) -> int:
        b = base.get(name)
        if b is None:
            b = base[name] = node_of_rank(min(ranks)) + _text_hash(name)
        if rank is None or fanin is None or len(ranks) <= fanin:
            return b % nodes
        idx = index.get(name)
        if idx is None:
            idx = index[name] = {r: i for i, r in enumerate(ranks)}
        return (b + 1 + idx[rank] // fanin) % nodes

    return route


# -- the coordinator -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Expansion:
    """Ask ``nodes`` for the records of ``ranks`` on ``group``, seqs ``lo``..``hi``."""

    id: int
    group: str
    lo: int
    hi: int
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    why: str

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"id": self.id, "group": self.group, "lo": self.lo, "hi": self.hi, "ranks": list(self.ranks)},
            separators=(",", ":"),
        ).encode()


@dataclass
class Outcome:
    desync: Desync | None = None
    lags: list[Lag] = field(default_factory=list)
    requests: list[Expansion] = field(default_factory=list)
    up: dict[int, bytes] = field(default_factory=dict)  # chunk summaries, for their roots' coordinators


@dataclass
class _Block:
    chain: int
    reporters: set
    bal: int = 0
    unknown: int = 0
    red: str = ""
    flagged: bool = False


@dataclass
class _GroupState:
    group: Group
    members: tuple[int, ...]  # the ids compared here: the group's ranks, a chunk's, or -(chunk + 1)
    chunk: int | None = None  # a chunk coordinator's chunk of the group
    root: bool = False  # members are chunk summaries
    frontier: dict[int, int] = field(default_factory=dict)  # rank -> f
    prefix: dict[int, list | None] = field(default_factory=dict)  # rank -> [k, chain, bal, unknown]
    epoch: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, _Block] = field(default_factory=dict)
    changed_at: float = 0.0
    dirty: bool = False
    asked: set = field(default_factory=set)  # (lo, hi) already expanded
    up_done: list = field(default_factory=list)  # chunk: closed, agreed blocks not yet sent up
    up_sent: bool = False


class Coordinator:
    """Compares the digests of the groups routed to it; see the module docstring."""

    def __init__(
        self,
        block: int = BLOCK,
        lag_idle: float = LAG_IDLE,
        settle: float = SETTLE,
        clock: Callable[[], float] = time.time,
        max_pending: int = MAX_PENDING,
        node: int = 0,
        fanin: int | None = None,
        route: Callable[[str, tuple, int | None], int] | None = None,
    ):
        """``node``, ``fanin`` and ``route`` (``coordinator_of``'s) for a coordinator of many nodes:
        groups larger than ``fanin`` are compared in chunks, their summaries sent up by ``poll``."""
        self.node = node
        self.fanin = fanin
        self.route = route
        self.block = block
        self.lag_idle = lag_idle
        self.settle = settle
        self.clock = clock
        self.max_pending = max_pending
        self.desync: Desync | None = None
        self.lags: list[Lag] = []
        self.expanded = 0  # ranges expanded so far
        self.unconfirmed = 0  # expanded ranges the exact check found healthy
        self.dropped = 0
        self._groups: dict[str, _GroupState] = {}
        self._node_of: dict[int, int] = {}
        self._ranks: dict[int, tuple[list, float]] = {}  # rank -> (summary, received at, own clock)
        self._defs: dict[str, Group] = {}
        self._requests: list[Expansion] = []
        self._open: dict[int, tuple[Expansion, dict[int, list]]] = {}
        self._next_id = 1
        self._lag_seen: set = set()
        self._now = 0.0

    def receive(self, message: bytes, now: float | None = None) -> None:
        """One node's digest; ``now``: when it arrived, on the clock ``poll`` is given (default: the
        last ``poll``'s), which ages the ranks' idle times for the lag check."""
        if now is not None:
            self._now = now
        msg = json.loads(message)
        node = msg["node"]
        for name, (desc, ranks) in msg["groups"].items():
            if name not in self._defs:
                self._defs[name] = Group(name, desc, unpack_ranks(ranks))
        for rank, where in msg.get("where", ()):
            self._node_of[rank] = where
        for rank, epoch, name, f, prefix, done in msg["members"]:
            if rank >= 0:
                self._node_of[rank] = node
            g = self._state(name, rank)
            if g.epoch.get(rank, epoch) != epoch:
                # A restarted rank: its seqs start again; drop what the group had pending.
                g.blocks.clear()
                g.asked.clear()
                g.frontier.pop(rank, None)
            g.epoch[rank] = epoch
            for k, chain, bal, unknown, red in done:
                self._block(g, rank, k, chain, bal, unknown, red)
            if g.frontier.get(rank) != f or g.prefix.get(rank) != prefix:
                g.changed_at = self._now
                g.dirty = True
            g.frontier[rank] = f
            g.prefix[rank] = prefix
        for summary in msg["ranks"]:
            self._ranks[summary[0]] = (summary, self._now)

    def _state(self, name: str, rank: int) -> _GroupState:
        group = self._defs[name]
        size = len(group.ranks)
        if rank < 0:
            key, chunk, members = name + "#root", None, tuple(-(c + 1) for c in range(-(-size // self.fanin)))
        elif self.fanin is not None and size > self.fanin:
            chunk = group.ranks.index(rank) // self.fanin
            key, members = f"{name}#{chunk}", group.ranks[chunk * self.fanin : (chunk + 1) * self.fanin]
        else:
            key, chunk, members = name, None, group.ranks
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _GroupState(group, members, chunk, rank < 0, changed_at=self._now)
        return g

    def _block(self, g: _GroupState, rank: int, k: int, chain: int, bal: int, unknown: int, red: str) -> None:
        b = g.blocks.get(k)
        if b is None:
            b = g.blocks[k] = _Block(chain, {rank}, red=red)
            if len(g.blocks) > self.max_pending:
                del g.blocks[next(iter(g.blocks))]
                self.dropped += 1
        elif rank in b.reporters:
            return
        else:
            b.reporters.add(rank)
            if (chain != b.chain or red_conflict(red, b.red)) and not b.flagged:
                b.flagged = True
                self._ask(g, k * self.block + 1, (k + 1) * self.block, "block")
            b.red = red_merge(b.red, red)
        b.bal = (b.bal + bal) & _M64
        b.unknown += unknown
        if len(b.reporters) >= len(g.members):
            del g.blocks[k]
            if g.chunk is not None:
                if not b.flagged:  # agreed in the chunk: the root compares it with the other chunks
                    g.up_done.append([k, b.chain, b.bal, b.unknown, b.red])
            elif not b.flagged and (b.bal or b.unknown):
                self._ask(g, k * self.block + 1, (k + 1) * self.block, "contract")

    def _ask(self, g: _GroupState, lo: int, hi: int, why: str) -> None:
        if (lo, hi) in g.asked or self.desync is not None:
            return
        g.asked.add((lo, hi))
        ranks = tuple(r for r in sorted(g.group.ranks if g.root else g.members) if r in self._node_of)
        nodes = tuple(sorted({self._node_of[r] for r in ranks}))
        req = Expansion(self._next_id, g.group.name, lo, hi, ranks, nodes, why)
        self._next_id += 1
        self.expanded += 1
        self._requests.append(req)
        self._open[req.id] = (req, {})

    def _frontiers(self, g: _GroupState, now: float) -> None:
        by_f: dict[int, list[int]] = {}
        for r, f in g.frontier.items():
            by_f.setdefault(f, []).append(r)
        for f, rs in by_f.items():
            if f % self.block == 0 or len(rs) < 2:
                continue  # a frontier at a block's end: the block itself is compared
            k = (f - 1) // self.block
            pre = [g.prefix[r] for r in rs]
            if any(p is None or p[0] != k for p in pre):
                continue
            lo = k * self.block + 1
            if len({p[1] for p in pre}) > 1 or _reds_conflict([p[4] for p in pre]):
                self._ask(g, lo, f, "frontier")
            elif (
                g.chunk is None
                and len(rs) == len(g.members)
                and (sum(p[2] for p in pre) & _M64 or any(p[3] for p in pre))
            ):
                self._ask(g, lo, f, "frontier contract")
        if len(by_f) > 1 and now - g.changed_at >= self.settle:
            low = min(by_f)
            lo = ((max(low, 1) - 1) // self.block) * self.block + 1
            hi = min(max(by_f), lo + SPAN_BLOCKS * self.block - 1)
            if hi > lo or len(by_f[low]) < len(g.frontier):
                self._ask(g, lo, hi, "settled")

    def receive_records(self, response: bytes) -> None:
        res = json.loads(response)
        entry = self._open.get(res["id"])
        if entry is not None:
            entry[1][res["node"]] = res["records"] if res.get("complete", True) else None

    def _judge(self, req: Expansion, answers: dict[int, list | None]) -> None:
        if any(a is None for a in answers.values()):
            self.unconfirmed += 1  # a range no longer kept: nothing claimed
            return
        group = self._defs[req.group]
        by_rank: dict[int, list[CollectiveEvent]] = {}
        for records in answers.values():
            for r in records:
                e = decode_event(r, group)
                by_rank.setdefault(e.rank, []).append(e)
        det = DesyncDetector(clock=self.clock)
        for rank in sorted(by_rank):
            det.feed(rank, sorted(by_rank[rank], key=lambda e: e.seq))
        if det.desync is not None and self.desync is None:
            self.desync = det.desync
        elif det.desync is None:
            self.unconfirmed += 1

    def poll(self, now: float) -> Outcome:
        """Compare what was received; ``now`` is the monotonic clock the nodes' ``message`` used."""
        self._now = now
        out = Outcome()
        for req_id, (req, answers) in list(self._open.items()):
            if set(answers) >= set(req.nodes):
                del self._open[req_id]
                self._judge(req, answers)
        if self.desync is None:
            for g in self._groups.values():
                if g.dirty or now - g.changed_at >= self.settle:
                    self._frontiers(g, now)
                    g.dirty = False
        out.requests, self._requests = self._requests, []
        out.desync = self.desync
        out.lags = self._check_lags(now)
        if self.route is not None:
            out.up = self._summaries(now)
        return out

    def _summaries(self, now: float) -> dict[int, bytes]:
        """Each chunk as one member of its group's root: its agreed closed blocks, and its frontier
        (the chunk's common frontier and merged prefix when every member is there and agrees, else its
        lowest frontier without a prefix)."""
        parts: dict[int, dict] = {}
        for g in self._groups.values():
            if g.chunk is None or not g.frontier:
                continue
            fs = set(g.frontier.values())
            pre = [g.prefix.get(r) for r in g.members]
            f = min(fs)
            prefix = None
            if len(fs) == 1 and len(g.frontier) == len(g.members) and all(p is not None for p in pre):
                chains = {p[1] for p in pre}
                reds = [p[4] for p in pre]
                if len(chains) == 1 and not _reds_conflict(reds):
                    merged = reds[0]
                    for x in reds[1:]:
                        merged = red_merge(merged, x)
                    prefix = [pre[0][0], chains.pop(), sum(p[2] for p in pre) & _M64, sum(p[3] for p in pre), merged]
            dest = self.route(g.group.name, g.group.ranks, None)
            p = parts.setdefault(dest, {"node": self.node, "t": now, "members": [], "ranks": [], "groups": {}})
            p["members"].append([-(g.chunk + 1), sum(g.epoch.values()), g.group.name, f, prefix, g.up_done])
            g.up_done = []
            if not g.up_sent:
                g.up_sent = True
                p["groups"][g.group.name] = [g.group.desc, pack_ranks(g.group.ranks)]
                p["where"] = p.get("where", []) + [[r, self._node_of[r]] for r in g.members if r in self._node_of]
        return {d: json.dumps(p, separators=(",", ":")).encode() for d, p in parts.items()}

    def _check_lags(self, now: float) -> list[Lag]:
        """``DesyncDetector.check_lags`` on the ranks' summaries and the groups' frontiers."""
        found = []
        for g in self._groups.values():
            if g.root:
                continue  # a laggard holds up its own chunk's members too: the chunk sees it
            found += self._group_lags(g, now)
        return found

    def _group_lags(self, g: _GroupState, now: float) -> list[Lag]:
        name = g.group.name
        waiting: dict[int, list] = {}
        for r in g.members:
            got = self._ranks.get(r)
            if got is None:
                continue
            summary, at = got
            rank, last_group, seq, step, p2p, completed, idle = summary
            if p2p or completed or last_group != name or idle + (now - at) < self.lag_idle:
                continue
            waiting.setdefault(seq, []).append(summary)
        found = []
        for seq, states in waiting.items():
            step = max(s[3] for s in states)
            waiters = {s[0] for s in states}
            for m in g.members:
                if m in waiters or m not in self._ranks:
                    continue
                behind = g.frontier.get(m, 0)
                rank_step = self._ranks[m][0][3]
                if behind >= seq or rank_step > step - 1:
                    continue
                key = (name, seq, m)
                if key in self._lag_seen:
                    continue
                self._lag_seen.add(key)
                lag = Lag(name, seq, step, tuple(sorted(waiters)), m, behind, rank_step, self.clock())
                self.lags.append(lag)
                found.append(lag)
        return found

    def pending(self) -> int:
        return sum(len(g.blocks) for g in self._groups.values())


class LocalDigest:
    """One node and its own coordinator, no transport: ``moedoctor run`` on one host through the
    digest layer. ``feed`` as ``DesyncDetector.feed``; ``poll(now, progress)`` exchanges, answers
    its own expansions and returns the ``Outcome``. ``bytes_sent`` counts what would cross nodes."""

    def __init__(self, block: int = BLOCK, settle: float = SETTLE, clock: Callable[[], float] = time.time):
        self.node = NodeDigest(0, block=block)
        self.coordinator = Coordinator(block=block, settle=settle, clock=clock)
        self.bytes_sent = 0

    def feed(self, rank: int, items: list, restarted: bool = False) -> None:
        self.node.feed(rank, items, restarted)

    @property
    def desync(self) -> Desync | None:
        return self.coordinator.desync

    def poll(self, now: float, progress: Mapping[int, Any] | None = None) -> Outcome:
        msg = self.node.message(now, progress)
        self.bytes_sent += len(msg)
        self.coordinator.receive(msg, now)
        out = self.coordinator.poll(now)
        for _ in range(2):  # answer this round's expansions and judge them at once
            if not out.requests:
                break
            for req in out.requests:
                ans = self.node.answer(req.to_bytes())
                self.bytes_sent += len(ans)
                self.coordinator.receive_records(ans)
            lags = out.lags
            out = self.coordinator.poll(now)
            out.lags = lags + out.lags
        return out
