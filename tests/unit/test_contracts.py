"""Variable-size collectives: compared on what must agree, and checked by the pairwise contract
(all_to_all splits, gather / scatter lists), offline and online, on factory-built events."""

from __future__ import annotations

import random

import pytest
from event_factory import ranks, run_of, world

from moedoctor.analysis import analyze
from moedoctor.analysis.contracts import breaches, breakers
from moedoctor.analysis.model import DivergenceKind, Verdict
from moedoctor.events import Group, Phase
from moedoctor.runner.online import DesyncDetector

DIM = 8


def dispatch(builders, counts, *, wrong: dict[int, list[int]] | None = None, line: int = 50, step: int = 0,
             group: Group | None = None, exchange: bool = True) -> None:
    """One expert-parallel dispatch: ``counts[i][j]`` rows from member i to member j, the counts
    exchanged first (unless not ``exchange``); ``wrong[i]``: member i's receive splits computed
    locally instead."""
    n = len(builders)
    for i, b in enumerate(builders):
        if exchange:
            b.coll("all_to_all", (n,), dtype="int64", line=line - 10, phase=Phase.FORWARD, step=step, group=group,
                   splits=((), ()))
        send = counts[i]
        recv = (wrong or {}).get(i) or [counts[j][i] for j in range(n)]
        b.coll("all_to_all", shapes=((sum(send), DIM),), out_shapes=((sum(recv), DIM),), line=line,
               phase=Phase.FORWARD, step=step, group=group, splits=(send, recv))


def routing(n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.choice([0, 0, 1, 3, 7, 20]) for _ in range(n)] for _ in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_uneven_splits_that_pair_up_are_healthy(n):
    rng = random.Random(n)
    bs = ranks(n)
    for step in range(5):
        dispatch(bs, routing(n, rng), step=step)
        for b in bs:
            b.coll("all_reduce", (1,), step=step)
    report = analyze(run_of(*bs))
    assert report.verdict == Verdict.HEALTHY, report.summary


def test_online_detector_accepts_random_uneven_dispatch():
    rng = random.Random(7)
    for trial in range(50):
        n = rng.choice([2, 3, 4, 8])
        bs = ranks(n)
        for step in range(3):
            dispatch(bs, routing(n, rng), step=step)
        det = DesyncDetector()
        for b in bs:
            det.feed(b.rank, b.events)
        assert det.desync is None, (trial, det.desync.line())


def test_receive_counts_computed_locally_break_the_contract():
    bs = ranks(3)
    counts = [[2, 5, 0], [4, 1, 9], [3, 3, 3]]
    dispatch(bs, counts, step=0)
    dispatch(bs, counts, step=1, wrong={1: [4, 1, 9]})  # rank 1 assumes symmetric traffic
    report = analyze(run_of(*bs, hang=True))
    assert report.pattern == "all-to-all-split-mismatch", report.summary
    assert report.culprit_ranks == [1]
    div = report.divergence
    assert div.kind == DivergenceKind.CONTRACT and div.seq == 4
    assert any("rank 1 expects 32 element(s) from rank 0, which sends it 40" == b for b in div.breaches), div.breaches
    assert report.suggestion.call_site.endswith("train.py:50")

    det = DesyncDetector()
    for b in bs:
        det.feed(b.rank, b.events)
    assert det.desync is not None and det.desync.seq == 4
    assert det.desync.classes[-1] == (1,)
    assert "rank 1 expects" in det.desync.line()


def test_breakers_blames_the_one_sender_when_it_breaks_every_pair():
    bs = ranks(3)
    n = 3
    for i, b in enumerate(bs):
        send = [2, 2, 2] if i != 2 else [3, 3, 3]  # rank 2 sends more than it announced
        recv = [2, 2, 2]
        b.coll("all_to_all", shapes=((sum(send), DIM),), out_shapes=((sum(recv), DIM),), splits=(send, recv))
    found = breaches({b.rank: b.events[0] for b in bs}, tuple(range(n)))
    assert found and breakers(found) == (2,)


def test_two_ranks_the_stale_receiver_is_named_whatever_its_rank():
    """Rank 0 kept receive counts from an earlier step; rank 1 sends what it routes now, and no count
    exchange preceded this dispatch. The divergence keeps the breakers last (not sorted by size,
    where rank 0 would come first)."""
    for stale in (0, 1):
        bs = ranks(2)
        counts = [[3, 5], [6, 5]]
        cached = [3, 5] if stale == 0 else [5, 3]
        dispatch(bs, counts, step=0, wrong={stale: cached}, exchange=False)
        report = analyze(run_of(*bs, hang=True))
        assert report.pattern == "all-to-all-split-mismatch", report.summary
        assert report.culprit_ranks == [stale], (stale, report.culprit_reasoning)


def test_one_broken_pair_after_a_count_exchange_names_no_culprit():
    """The two ranks exchanged their counts in this step, then one pair disagrees: the receiver took
    the sender's announcement (or changed it), or the sender sends other rows than it announced
    (counts of real tokens announced, padding rows sent: held-out ``ep_moe_lm_masked_router_counts``).
    The counts' values are not recorded: the pattern is named, the culprit left open, and why said."""
    bs = ranks(2)
    dispatch(bs, [[3, 5], [6, 5]], step=0, wrong={1: [5, 3]})
    report = analyze(run_of(*bs, hang=True))
    assert report.pattern == "all-to-all-split-mismatch", report.summary
    assert report.culprit_ranks == []
    assert any("exchanged integer counts" in e and "no culprit is named" in e for e in report.evidence)
    # Receive splits that copy the rank's own send splits were computed locally: that receiver.
    bs = ranks(2)
    dispatch(bs, [[3, 5], [6, 5]], step=0, wrong={1: [6, 5]})
    assert analyze(run_of(*bs, hang=True)).culprit_ranks == [1]


def test_a_rank_whose_whole_layout_differs_is_named_not_every_receiver():
    """Capacity from local tokens: rank 2 sends and expects 2 rows per peer, the others 3. Every rank
    is a receiver of some breach; rank 2 takes part in all of them, each other rank only with it."""
    bs = ranks(3)
    for i, b in enumerate(bs):
        cap = 2 if i == 2 else 3
        b.coll("all_to_all", shapes=((3 * cap, DIM),), out_shapes=((3 * cap, DIM),), splits=((), ()))
    found = breaches({b.rank: b.events[0] for b in bs}, (0, 1, 2))
    assert len(found) == 4 and breakers(found) == (2,)
    assert analyze(run_of(*bs, hang=True)).culprit_ranks == [2]


def test_equal_splits_and_list_all_to_all():
    bs = ranks(2)
    for b in bs:  # no splits: equal halves
        b.coll("all_to_all", (6, DIM), splits=((), ()))
    # the list form: one tensor per member, sizes per pair
    bs[0].coll("all_to_all", shapes=((3,), (5,)), out_shapes=((3,), (2,)))
    bs[1].coll("all_to_all", shapes=((2,), (4,)), out_shapes=((5,), (4,)))
    assert analyze(run_of(*bs)).verdict == Verdict.HEALTHY
    bad = ranks(2)
    bad[0].coll("all_to_all", shapes=((3,), (5,)), out_shapes=((3,), (2,)))
    bad[1].coll("all_to_all", shapes=((2,), (4,)), out_shapes=((6,), (4,)))
    report = analyze(run_of(*bad, hang=True))
    assert report.divergence.kind == DivergenceKind.CONTRACT and report.culprit_ranks == [1]


def test_unknown_sizes_claim_no_breach():
    bs = ranks(2)
    bs[0].coll("all_to_all", shapes=((7, DIM),), out_shapes=((9, DIM),), splits=((3, 4), (3, -1)))  # symbolic
    bs[1].coll("all_to_all", shapes=((9, DIM),), out_shapes=((7, DIM),), splits=((2, 7), (4, 3)))
    assert breaches({b.rank: b.events[0] for b in bs}, (0, 1)) == []


def test_row_sizes_and_dtypes_must_still_agree():
    bs = ranks(2)
    bs[0].coll("all_to_all", shapes=((4, 8),), splits=((2, 2), (2, 2)))
    bs[1].coll("all_to_all", shapes=((4, 16),), splits=((2, 2), (2, 2)))
    report = analyze(run_of(*bs, hang=True))
    assert report.divergence.kind == DivergenceKind.MISMATCH


def test_capacity_laid_out_as_a_middle_dimension_is_a_split_question():
    """DeepSpeed-MoE's dispatch buffer [experts, capacity, hidden] with equal splits: capacities from
    local counts (9 and 8) make each member's chunk another size than its peer expects. The rows'
    trailing sizes differ, but the token width agrees: the contract judges it (different-splits,
    both ranks), not a shape mismatch."""
    bs = ranks(2)
    for b, cap in zip(bs, (9, 8)):
        b.coll("all_to_all", shapes=((2, cap, DIM),), out_shapes=((2, cap, DIM),), line=15, phase=Phase.FORWARD)
    report = analyze(run_of(*bs, hang=True))
    assert report.divergence.kind == DivergenceKind.CONTRACT
    assert report.mechanism.mechanism.value == "different-splits"
    assert report.pattern == "all-to-all-split-mismatch" and report.culprit_ranks == [0, 1]
    # The same buffers that pair up (one capacity) are healthy; another token width stays a mismatch.
    bs = ranks(2)
    for b, width in zip(bs, (DIM, 2 * DIM)):
        b.coll("all_to_all", shapes=((2, 9, width),), out_shapes=((2, 9, width),), line=15, phase=Phase.FORWARD)
    assert analyze(run_of(*bs, hang=True)).divergence.kind == DivergenceKind.MISMATCH


def test_uneven_all_gather_gather_and_varying_roots_are_healthy():
    g = world(3)
    bs = ranks(3)
    outs = ((2,), (5,), (1,))
    for i, b in enumerate(bs):
        b.coll("all_gather", shapes=(outs[i],), out_shapes=outs, group=g)          # uneven list all_gather
        b.coll("gather", shapes=(outs[i],), out_shapes=outs if i == 1 else (), root=1, group=g)
        b.coll("scatter", shapes=outs if i == 2 else (), out_shapes=(outs[i],), root=2, group=g)
        for step in range(3):
            b.coll("broadcast", (4,), root=step % 3, step=step, group=g)
    assert analyze(run_of(*bs)).verdict == Verdict.HEALTHY


def test_gather_root_list_that_does_not_match_a_member():
    bs = ranks(2)
    bs[0].coll("gather", shapes=((3,),), out_shapes=((3,), (4,)), root=0)
    bs[1].coll("gather", shapes=((5,),), out_shapes=(), root=0)
    report = analyze(run_of(*bs, hang=True))
    assert report.divergence.kind == DivergenceKind.CONTRACT
    assert report.divergence.breaches == ("rank 0 expects 4 element(s) from rank 1, which sends it 5",)


def test_broadcast_roots_that_differ_are_a_mismatch():
    bs = ranks(2)
    bs[0].coll("broadcast", (4,), root=0)
    bs[1].coll("broadcast", (4,), root=1)
    report = analyze(run_of(*bs, hang=True))
    assert report.divergence.kind == DivergenceKind.MISMATCH


def test_every_rank_computing_its_receive_counts_locally_names_them_all():
    bs = ranks(2)
    sends = [[3, 5], [2, 7]]
    for i, b in enumerate(bs):  # each rank takes its own send counts as receive counts
        b.coll("all_to_all", shapes=((sum(sends[i]), DIM),), out_shapes=((sum(sends[i]), DIM),),
               splits=(sends[i], sends[i]))
    report = analyze(run_of(*bs, hang=True))
    assert report.pattern == "all-to-all-split-mismatch" and report.culprit_ranks == [0, 1]


def test_functional_all_to_all_single_has_no_output_tensor_but_its_splits_still_count():
    """_c10d_functional::all_to_all_single allocates its output: the record has no output shape."""
    bs = ranks(2)
    sends = [[4, 4], [1, 7]]
    recvs = {0: [4, 1], 1: [4, 3]}  # rank 1 expects 3 rows from itself; it sends itself 7
    for i, b in enumerate(bs):
        b.coll("all_to_all", shapes=((8, DIM),), out_shapes=(), splits=(sends[i], recvs[i]),
               raw="_c10d_functional::all_to_all_single")
    report = analyze(run_of(*bs, hang=True))
    assert report.pattern == "all-to-all-split-mismatch" and report.culprit_ranks == [1], report.summary
    ok = ranks(2)
    for i, b in enumerate(ok):
        b.coll("all_to_all", shapes=((8, DIM),), out_shapes=(), splits=(sends[i], [sends[0][i], sends[1][i]]),
               raw="_c10d_functional::all_to_all_single")
    assert analyze(run_of(*ok)).verdict == Verdict.HEALTHY
