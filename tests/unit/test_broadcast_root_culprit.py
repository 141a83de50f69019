"""A broadcast every rank issued from one call site with one root, in other sizes (corpus 26's lazily
registered buffers broadcast in registration order): the root's tensor is what travels, so the rank
whose size differs from the root's is the culprit (``culprits._off_root``), on factory-built events;
not when the ranks issued it from different call sites (two collectives, no root to compare with)."""

from __future__ import annotations

from event_factory import ranks, run_of

from moedoctor.analysis import analyze


def _run(other_line: int = 65, root: int = 0):
    a, b = ranks(2)
    a.coll("broadcast", (6,), line=65, root=root, done=False)
    b.coll("broadcast", (4,), line=other_line, root=root, done=False)
    return run_of(a, b, hang=True)


def test_the_rank_whose_size_differs_from_the_roots_is_the_culprit():
    report = analyze(_run())
    assert report.pattern == "shape-mismatch", report.pattern
    assert report.culprit_ranks == [1], report.culprit_ranks


def test_the_root_decides_which_side_deviates():
    assert analyze(_run(root=1)).culprit_ranks == [0]


def test_two_call_sites_are_no_root_comparison():
    assert analyze(_run(other_line=70)).culprit_ranks == []
