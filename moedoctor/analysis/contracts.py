"""The pairwise size contract of the variable-size collectives.

Their sizes legitimately differ across ranks (expert-parallel token dispatch sends data-dependent
row counts with ``all_to_all_single``), so ``CollectiveEvent.signature`` leaves them out; what must
hold instead is that every pair agrees on what travels between them:

- ``all_to_all``: rank i's output split for j equals rank j's input split for i (in elements: rows
  times the row's size; no splits given means equal splits);
- ``gather``: the root's output j has as many elements as rank j's input;
- ``scatter``: the root's input j has as many elements as rank j's output.

A healthy job never breaks it; a job that does (receive counts computed locally instead of
exchanged) aborts on Gloo and hangs or mixes tokens on NCCL. Checked only when every member of the
group has reported the collective and each side's sizes are fully known (no symbolic size, no shape
list cut at the recorder's cap): where anything is missing, no breach is claimed.

Nothing here imports torch: the online detector of ``moedoctor run`` and the offline analysis share it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moedoctor.events import CONTRACT_OPS, CollectiveEvent


@dataclass(frozen=True, slots=True)
class Breach:
    """``receiver`` expects ``expected`` elements from ``sender``, which sends ``sent``."""

    op: str
    sender: int
    receiver: int
    sent: int
    expected: int

    def line(self) -> str:
        return (
            f"rank {self.receiver} expects {self.expected} element(s) from rank {self.sender}, "
            f"which sends it {self.sent}"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _per_peer(shapes: tuple[tuple[int, ...], ...], splits: tuple[int, ...] | None, size: int) -> list[int] | None:
    """Elements exchanged with each of the ``size`` members, or None where it cannot be known."""
    if len(shapes) == 1:
        shape = shapes[0]
        if not shape:
            return None
        row = _numel(shape[1:])
        if splits:
            if len(splits) != size or any(not isinstance(s, int) or s < 0 for s in splits):
                return None
            return [s * row for s in splits]
        if shape[0] % size:
            return None
        return [shape[0] // size * row] * size
    if len(shapes) == size:  # a list of tensors, one per member
        return [_numel(s) for s in shapes]
    return None


def _all_to_all(events: dict[int, CollectiveEvent], ranks: tuple[int, ...]) -> list[Breach]:
    size = len(ranks)
    sends, recvs = {}, {}
    for r in ranks:
        e = events[r]
        sends[r] = _per_peer(e.in_shapes, e.in_splits, size)
        out_shapes = e.out_shapes
        if not out_shapes and e.out_splits and len(e.in_shapes) == 1 and e.in_shapes[0]:
            # A functional all_to_all_single allocates its output: rows received times the input's row.
            out_shapes = ((sum(e.out_splits),) + tuple(e.in_shapes[0][1:]),)
        recvs[r] = _per_peer(out_shapes, e.out_splits, size)
        if sends[r] is None or recvs[r] is None:
            return []
    found = []
    for i, receiver in enumerate(ranks):
        for j, sender in enumerate(ranks):
            sent, expected = sends[sender][i], recvs[receiver][j]
            if sent != expected:
                found.append(Breach("all_to_all", sender, receiver, sent, expected))
    return found


def _rooted(events: dict[int, CollectiveEvent], ranks: tuple[int, ...], op: str) -> list[Breach]:
    roots = {e.root for e in events.values()}
    if len(roots) != 1 or (root := roots.pop()) not in events:
        return []  # roots that differ are a signature mismatch, not a size question
    lists = events[root].out_shapes if op == "gather" else events[root].in_shapes
    if len(lists) != len(ranks):
        return []
    found = []
    for j, other in enumerate(ranks):
        mine = events[other].in_shapes if op == "gather" else events[other].out_shapes
        if len(mine) != 1:
            return []
        peer, listed = _numel(mine[0]), _numel(lists[j])
        if peer != listed:
            if op == "gather":
                found.append(Breach(op, other, root, peer, listed))
            else:
                found.append(Breach(op, root, other, listed, peer))
    return found


def breaches(events: Mapping[int, CollectiveEvent], ranks: tuple[int, ...]) -> list[Breach]:
    """Every pair that breaks the contract at one (group, seq); [] when the contract holds, the op
    has none, or some member's side is not (fully) known. ``ranks``: the group's members in
    group-rank order."""
    if len(ranks) < 2 or any(r not in events for r in ranks):
        return []
    ops = {e.op for e in events.values()}
    if len(ops) != 1:
        return []
    op = ops.pop()
    if op not in CONTRACT_OPS:
        return []
    if op == "all_to_all":
        return _all_to_all(dict(events), ranks)
    return _rooted(dict(events), ranks, op)


def breakers(found: list[Breach]) -> tuple[int, ...]:
    """The ranks whose side disagrees with everyone else's: the one receiver (or sender) that every
    breach names; else the ranks that take part in the most breaches, when they are fewer than all
    (a rank whose whole layout differs, e.g. a capacity from its local token count, breaks the
    contract with every peer, each peer only with it); else the receivers (a receive count computed
    locally is the usual bug)."""
    receivers = {b.receiver for b in found}
    senders = {b.sender for b in found}
    if len(receivers) == 1:
        return tuple(receivers)
    if len(senders) == 1:
        return tuple(senders)
    involved: dict[int, int] = {}
    for b in found:
        for r in {b.sender, b.receiver}:
            involved[r] = involved.get(r, 0) + 1
    most = max(involved.values())
    top = sorted(r for r, n in involved.items() if n == most)
    if len(top) < len(involved):
        return tuple(top)
    return tuple(sorted(receivers))


def contract_classes(found: list[Breach], ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """The group split by a broken contract: the members that keep it, then the breakers (empty
    sides dropped), as the offline divergence and the online desync both report it."""
    bad = breakers(found)
    return [c for c in (tuple(r for r in ranks if r not in bad), bad) if c]
