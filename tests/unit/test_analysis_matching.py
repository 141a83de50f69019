"""Per-group matching, culprits and the wait-for graph on factory-built events; none of it may
depend on the order the trace files were read in."""

from __future__ import annotations

import random

import pytest
from analysis_scenarios import SCENARIOS
from event_factory import both, manifest, ranks, run_of, world

from moedoctor.analysis import analyze
from moedoctor.analysis.matching import all_divergences, first_divergence
from moedoctor.analysis.model import DivergenceKind
from moedoctor.analysis.evidence.view import RunView
from moedoctor.events import Group, Phase
from moedoctor.render.json_report import report_to_dict


def test_first_divergence_is_the_first_differing_seq_not_a_later_one():
    a, b = ranks(2)
    for i in range(5):
        both((a, b), "all_reduce", (8,), line=10)
    a.coll("all_reduce", (8,), line=10)
    b.coll("all_reduce", (9,), line=10)           # #6 differs
    for i in range(3):
        a.coll("broadcast", (8,), line=11)
        b.coll("all_gather", (8,), line=12)
    div = first_divergence(RunView(run_of(a, b, hang=True)), "0")
    assert div.kind == DivergenceKind.MISMATCH and div.seq == 6
    assert div.per_rank[0].shapes == ((8,),) and div.per_rank[1].shapes == ((9,),)


def test_reduce_ops_compared_only_where_both_known():
    a, b = ranks(2)
    a.coll("all_reduce", (8,), reduce_op="sum")
    b.coll("all_reduce", (8,), reduce_op=None)   # unknown: agrees
    a.coll("all_reduce", (8,), reduce_op="sum")
    b.coll("all_reduce", (8,), reduce_op="max")  # known on both: differs
    div = first_divergence(RunView(run_of(a, b)), "0")
    assert div.seq == 2 and div.kind == DivergenceKind.MISMATCH and len(div.classes) == 2


def test_missing_ranks_never_reached_it():
    a, b, c = ranks(3)
    both((a, b, c), "all_reduce", (8,))
    both((a, b), "all_reduce", (8,), done=False)
    div = first_divergence(RunView(run_of(a, b, c, hang=True)), "0")
    assert div.kind == DivergenceKind.MISSING and div.seq == 2 and div.missing == (2,)
    assert div.per_rank[2] is None


def test_p2p_matched_per_peer_pair():
    a, b = ranks(2)
    a.p2p("send", 1, (4,))
    b.p2p("recv", 0, (4,))
    a.p2p("send", 1, (4,), done=False)           # no matching recv on rank 1
    divs = all_divergences(RunView(run_of(a, b, hang=True)))
    assert len(divs) == 1 and divs[0].kind == DivergenceKind.P2P and divs[0].seq == 2
    assert divs[0].peers == (0, 1) and divs[0].missing == (1,)
    a2, b2 = ranks(2)
    a2.p2p("send", 1, (4,))
    b2.p2p("recv", 0, (5,))                      # shapes differ
    (div,) = all_divergences(RunView(run_of(a2, b2, hang=True)))
    assert div.kind == DivergenceKind.P2P and not div.missing


def test_p2p_matched_per_direction_when_both_neighbours_send_first():
    """A 1F1B batch_isend_irecv: each rank posts its send before its recv; a's sends meet b's recvs."""
    a, b = ranks(2)
    for _ in range(3):
        a.p2p("send", 1, (3, 16))
        b.p2p("send", 0, (3, 16))
        a.p2p("recv", 1, (3, 16))
        b.p2p("recv", 0, (3, 16))
    assert all_divergences(RunView(run_of(a, b))) == []
    a.p2p("recv", 1, (3, 16), done=False)        # a recv rank 1 never sends
    (div,) = all_divergences(RunView(run_of(a, b, hang=True)))
    assert div.kind == DivergenceKind.P2P and div.missing == (1,) and div.seq == 7


def test_groups_matched_separately_and_interleaving_may_differ():
    g1, g2 = Group("1", "tp", (0, 1)), Group("2", "dp", (0, 1))
    a, b = ranks(2)
    a.coll("all_reduce", (8,), group=g1).coll("all_gather", (4,), group=g2)
    b.coll("all_gather", (4,), group=g2).coll("all_reduce", (8,), group=g1)   # other order, both complete
    report = analyze(run_of(a, b, manifest_info=manifest({0: 0, 1: 0}, hang=False, source="launcher")))
    assert report.verdict.value == "healthy" and report.groups == []


def test_minority_is_the_culprit_whatever_its_rank():
    for odd in range(4):
        builders = ranks(4)
        for step in range(2):
            both(builders, "all_reduce", (8,), step=step, line=10)
        for r, b in enumerate(builders):
            b.coll("broadcast" if r == odd else "all_reduce", (8,), step=2, line=10, done=False)
        report = analyze(run_of(*builders, hang=True))
        assert report.culprit_ranks == [odd], report.culprit_reasoning
        assert "3 of 4 ranks" in report.culprit_reasoning


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_report_does_not_depend_on_file_order(name):
    run = SCENARIOS[name][0]()
    expected = report_to_dict(analyze(run))
    for seed in range(3):
        shuffled = SCENARIOS[name][0]()
        random.Random(seed).shuffle(shuffled.traces)
        shuffled.traces.reverse() if seed == 2 else None
        assert report_to_dict(analyze(shuffled)) == expected


def test_two_rank_culprit_follows_the_rank_not_the_position():
    """Swap which rank skips: the culprit follows (a file-order heuristic would blame one side)."""
    from analysis_scenarios import _fsdp_step
    from moedoctor.events import Phase

    for skipper in (0, 1):
        a, b = ranks(2)
        for step in range(2):
            for r in (a, b):
                _fsdp_step(r, step)
        for r in (a, b):
            r.coll("all_gather", (272,), phase=Phase.FORWARD, step=2, module="0", line=69)
        for idx, r in enumerate((a, b)):
            if idx == skipper:
                r.ev("grad_norm", 2, norm="nan", finite=False, site="/job/optim.py:82")
                r.coll("all_gather", (272,), phase=Phase.FORWARD, step=2, module="0", line=69, done=False)
            else:
                r.ev("grad_norm", 2, norm=1.0, finite=True, site="/job/optim.py:82")
                r.ev("optimizer_step_begin", 2)
                r.coll("all_reduce", (), phase=Phase.OPTIMIZER, step=2, line=45, file="/job/optim.py", done=False)
        report = analyze(run_of(a, b, hang=True))
        assert report.pattern == "skipped-optimizer-step" and report.culprit_ranks == [skipper]


def test_extra_collective_after_the_others_finished_blames_the_extra_rank():
    from moedoctor.events import Coverage

    a, b = ranks(2)
    for step in range(3):
        both((a, b), "all_reduce", (577,), step=step, line=50)
    a.coll("barrier", (), step=3, line=99, function="log_done", done=False)
    b.coverage.append(Coverage(1, 2000.0, "exit", ()))
    report = analyze(run_of(a, b, hang=True))
    assert report.culprit_ranks == [0] and report.pattern == "rank-conditional-collective"


def test_a_rank_that_raised_did_not_finish_normally_though_it_wrote_its_exit_coverage():
    """DDP's reducer raised on rank 1 (exit 1): the interpreter still wrote its final coverage record.
    Rank 1 never issued the all_reduce rank 0 waits in: rank 1 is the culprit, not rank 0's 'extra' op."""
    from event_factory import manifest
    from moedoctor.events import Coverage

    a, b = ranks(2)
    for step in range(3):
        both((a, b), "all_reduce", (151,), step=step, line=86, phase=Phase.BACKWARD)
    a.coll("all_reduce", (151,), step=3, line=86, phase=Phase.BACKWARD, done=False)
    b.coverage.append(Coverage(1, 2000.0, "exit", ()))
    report = analyze(run_of(a, b, manifest_info=manifest({0: -15, 1: 1})))
    assert report.culprit_ranks == [1], report.culprit_reasoning


def test_wait_chain_ends_at_the_root():
    """Rank 0 waits on group A for rank 1, rank 1 waits on group B for rank 2, rank 2 is stuck elsewhere."""
    from event_factory import in_collective, stack

    ga, gb = Group("1", "a", (0, 1)), Group("2", "b", (1, 2))
    a, b, c = ranks(3)
    a.coll("all_reduce", (8,), group=ga).coll("all_reduce", (8,), group=ga, done=False)
    b.coll("all_reduce", (8,), group=ga).coll("all_reduce", (8,), group=gb)
    b.coll("all_reduce", (8,), group=gb, done=False)
    c.coll("all_reduce", (8,), group=gb)
    stacks = [in_collective(0), in_collective(1),
              stack(2, ("load_batch", "/job/data.py", 12), ("main", "/job/train.py", 5))]
    report = analyze(run_of(a, b, c, hang=True, stacks=stacks))
    assert report.pattern == "straggler" and report.culprit_ranks == [2]
    assert "load_batch" in report.summary


def test_world_group_members_without_events_count_as_missing():
    a, b = ranks(2)
    a.coll("all_reduce", (8,), group=world(2), done=False)
    b.ev("backward_begin", 0)
    div = first_divergence(RunView(run_of(a, b, hang=True)), "0")
    assert div.kind == DivergenceKind.MISSING and div.missing == (1,)
