"""``inactive-experts`` culprits when every rank has idle experts: an FSDP unit's reduce-scatter
smaller than the unit its all-gather gathered in that step lacks gradients, on every rank that
reduces less than the whole unit (factory-built events)."""

from __future__ import annotations

from event_factory import ranks, run_of

from moedoctor.analysis import analyze
from moedoctor.events import Phase


def _unit(rank0_size: int):
    """FSDP unit layers.1 gathers 6496 elements (3248 per rank) and reduce-scatters them in
    backward; at step 2 rank 1 reduces 4960 and rank 0 ``rank0_size``."""
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_gather", (3248,), out_shapes=((6496,),), phase=Phase.FORWARD, step=step,
                   module="layers.1", line=151, file="/job/moe.py")
            size = 6496 if step < 2 else (4960 if r is b else rank0_size)
            r.coll("reduce_scatter", (size,), out_shapes=((size // 2,),), phase=Phase.BACKWARD, step=step,
                   module="layers.1", line=53, reduce_op="avg", done=step < 2)
            if step < 2:
                r.coll("reduce_scatter", (2064,), phase=Phase.BACKWARD, step=step, line=53, reduce_op="avg")
    return run_of(a, b, hang=True)


def test_every_rank_reducing_less_than_the_gathered_unit_is_a_culprit():
    report = analyze(_unit(5600))
    assert report.pattern == "inactive-experts", report.summary
    assert report.culprit_ranks == [0, 1], report.culprit_ranks


def test_a_rank_reducing_the_whole_unit_is_not_a_culprit():
    report = analyze(_unit(6496))
    assert report.pattern == "inactive-experts", report.summary
    assert report.culprit_ranks == [1], report.culprit_ranks
