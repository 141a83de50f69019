"""Per-group matching: the first sequence number where the ranks of a group disagree.

Collectives are matched by (group, seq), p2p ops by (group, peer pair, p2p seq); the ranks that did
the same thing at that point form classes, ordered by size then lowest rank, so neither the
matching nor the classes depend on the order trace files were read in.
"""

from __future__ import annotations

from collections import defaultdict

from moedoctor.analysis.contracts import breaches, contract_classes
from moedoctor.analysis.model import Divergence, DivergenceKind, OpView
from moedoctor.analysis.evidence.view import RunView
from moedoctor.events import CollectiveEvent


def first_divergence(view: RunView, group: str) -> Divergence | None:
    """The first seq of ``group`` where the traced members' collectives differ (op, shapes,
    dtypes, or reduce op where both sides know it), some members never issued it, or every member
    issued it but their sizes break the pairwise contract (``contracts``: all_to_all splits)."""
    members = view.traced_members(group)
    if len(members) < 2:
        return None
    maps = {r: view.seq_map(r, group) for r in members}
    for seq in view.seqs(group):
        present = {r: maps[r][seq] for r in members if seq in maps[r]}
        if not present:
            continue
        missing = tuple(r for r in members if r not in present and view.never_reached(r, group, seq))
        classes = op_classes(present)
        if not missing and len(classes) > 1 and _rows_differ_only(present):
            # An all_to_all is a flat exchange: rows of other trailing sizes are a question of what
            # each pair sends and expects, answered by the contract where every side is known.
            found = breaches(present, view.groups[group].ranks)
            if found:
                div = _divergence(view, group, seq, present, (), [], DivergenceKind.CONTRACT)
                div.classes = contract_classes(found, members)
                div.breaches = tuple(b.line() for b in found)
                return div
        if missing or len(classes) > 1:
            classes = classes + ([missing] if missing else [])
            return _divergence(
                view,
                group,
                seq,
                present,
                missing,
                classes,
                DivergenceKind.MISMATCH if len(op_classes(present)) > 1 else DivergenceKind.MISSING,
            )
        found = breaches(present, view.groups[group].ranks)
        if found:
            div = _divergence(view, group, seq, present, (), [], DivergenceKind.CONTRACT)
            div.classes = contract_classes(found, members)  # keepers, then breakers: not sorted by size
            div.breaches = tuple(b.line() for b in found)
            return div
    return None


def _rows_differ_only(present: dict[int, CollectiveEvent]) -> bool:
    """Every rank issued one all_to_all (one tensor each way) from one call site with the same
    dtypes and the same last dimension (a token's width): only the number of tokens in each member's
    chunk (a capacity laid out as a middle dimension, ``[experts, capacity, hidden]``) sets them apart.
    A different last dimension is a different tensor, a shape mismatch."""
    events = list(present.values())
    return (
        len(events) > 1
        and all(e.op == "all_to_all" and len(e.in_shapes) == 1 and len(e.in_shapes[0]) >= 3 for e in events)
        and len({e.call_site.where if e.call_site else None for e in events}) == 1
        and len({e.dtypes for e in events}) == 1
        and len({(len(e.in_shapes[0]), e.in_shapes[0][-1]) for e in events}) == 1
    )


def stalled(view: RunView, group: str) -> Divergence | None:
    """Every traced member's last collective on ``group`` is the same one (same seq, same
    signature) and none of them completed it: the group is stuck *inside* one collective."""
    members = view.traced_members(group)
    if len(members) < 2 or len(members) < len(view.groups[group].ranks):
        return None
    seqs = {view.last_seq(r, group) for r in members}
    if len(seqs) != 1:
        return None
    seq = seqs.pop()
    present = {r: view.event(r, group, seq) for r in members}
    if seq == 0 or any(e is None or e.completed is not None for e in present.values()):
        return None
    if len(op_classes(present)) != 1:
        return None
    return _divergence(view, group, seq, present, (), [tuple(members)], DivergenceKind.STALLED)


def p2p_divergences(view: RunView, group: str) -> list[Divergence]:
    """Per peer pair of ``group``: the first send without its recv on the peer (or with another
    payload), matched per direction: a's k-th send to b meets b's k-th recv from a, whatever else
    either rank posted in between (in a batch of isend/irecv both neighbours may send first, as
    pipeline schedules do). A send whose recv is absent counts only when the peer's whole p2p history
    with that rank is loaded and its trace is closed: it then certainly never posted it."""
    peers = view.p2p_peers(group)
    pairs = sorted({tuple(sorted((a, b))) for a, by_peer in peers.items() for b in by_peer if a != b})
    found = []
    for a, b in pairs:
        first = None
        for src, dst in ((a, b), (b, a)):
            div = _direction(view, group, peers, src, dst)
            if div is not None and (first is None or div.earliest < first.earliest):
                first = div
        if first is not None:
            found.append(first)
    return found


def _direction(view: RunView, group: str, peers: dict, src: int, dst: int) -> Divergence | None:
    mine, theirs = peers.get(src, {}).get(dst, {}), peers.get(dst, {}).get(src, {})
    sends = [mine[n] for n in sorted(mine) if mine[n].op == "send"]
    recvs = [theirs[n] for n in sorted(theirs) if theirs[n].op == "recv"]
    pair = (min(src, dst), max(src, dst))
    for send, recv in zip(sends, recvs):
        if _payload(send) != _payload(recv):
            return _divergence(
                view, group, send.p2p_seq, {src: send, dst: recv}, (), [(src,), (dst,)], DivergenceKind.P2P, peers=pair
            )
    if len(sends) == len(recvs):
        return None
    # One side posted more: the other never posted its match, if its whole history is here.
    extra, there, lagging, posted = (
        (sends[len(recvs)], src, dst, theirs) if len(sends) > len(recvs) else (recvs[len(sends)], dst, src, mine)
    )
    if (
        lagging in view.traces
        and lagging not in view.run.open_ended
        and len(posted) == view.last_p2p(lagging, group, there)
    ):
        return _divergence(
            view,
            group,
            extra.p2p_seq,
            {there: extra},
            (lagging,),
            [(there,), (lagging,)],
            DivergenceKind.P2P,
            peers=pair,
        )
    return None


def _payload(e: CollectiveEvent) -> tuple:
    return (e.in_shapes or e.out_shapes, e.dtypes)


def op_classes(present: dict[int, CollectiveEvent]) -> list[tuple[int, ...]]:
    """Ranks grouped by what they issued at one (group, seq); a reduce op splits a class only where
    both are known. More than one class is a mismatch: the one definition of "the ranks did the same
    thing", shared by the offline analysis and ``moedoctor run``'s online detector."""
    by_sig: dict[tuple, list[int]] = defaultdict(list)
    for r in sorted(present):
        by_sig[present[r].signature()].append(r)
    classes: list[list[int]] = []
    for ranks in by_sig.values():
        known: dict[str, list[int]] = defaultdict(list)
        unknown: list[int] = []
        for r in ranks:
            (known[present[r].reduce_op] if present[r].reduce_op else unknown).append(r)
        if len(known) <= 1:
            classes.append(ranks)
            continue
        split = sorted(known.values(), key=lambda rs: (-len(rs), rs[0]))
        split[0] = sorted(split[0] + unknown)
        classes.extend(split)
    return sorted((tuple(c) for c in classes), key=lambda c: (-len(c), c[0]))


def _divergence(
    view: RunView,
    group: str,
    seq: int,
    present: dict[int, CollectiveEvent],
    missing: tuple[int, ...],
    classes: list[tuple[int, ...]],
    kind: DivergenceKind,
    peers: tuple[int, int] | None = None,
) -> Divergence:
    per_rank: dict[int, OpView | None] = {r: OpView.of(e) for r, e in sorted(present.items())}
    for r in missing:
        per_rank[r] = None
    per_rank = dict(sorted(per_rank.items()))
    return Divergence(
        kind=kind,
        group=view.groups[group],
        seq=seq,
        per_rank=per_rank,
        classes=sorted(classes, key=lambda c: (-len(c), c[0])),
        missing=tuple(sorted(missing)),
        peers=peers,
    )


def all_divergences(view: RunView) -> list[Divergence]:
    """Every group's first divergence (collectives and p2p), in group-name order."""
    found = []
    for group in sorted(view.groups, key=_group_key):
        div = first_divergence(view, group)
        if div is not None:
            found.append(div)
        found.extend(p2p_divergences(view, group))
    return found


def _group_key(name: str):
    return (0, int(name), "") if name.isdigit() else (1, 0, name)
