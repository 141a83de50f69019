"""The parameter consistency check (``moedoctor.analysis.params``) on factory-built fingerprints."""

from __future__ import annotations

import json

from moedoctor.analysis.params import (
    PATTERN, REPLICATED_DIFFERS, SHARD_IDENTICAL, STATE_DIFFERS, check_params, check_run_dir,
)
from moedoctor.trace.params_format import (
    POINT_BEFORE_BROADCAST, POINT_PREPARED, POINT_STEP, Checkpoint, Layout, TensorPrint, decode, encode,
)
from tests.event_factory import ranks

FSDP = Layout((0, 1), (2,), ("S0",))
EP = Layout((0, 1), (2,), ("S0",))
REPL = Layout((0, 1), (2,), ("R",))


def fp(seed: float, constant: bool = False) -> tuple[float, ...]:
    if constant:
        return (4.0, 4.0, 3.1, 1.0, 1.0)
    return (seed, seed * seed + 1, seed * 0.7, seed - 1, seed + 1)


def tp(name, seed, shape=(2, 4), layout=None, constant=False, extra=None) -> TensorPrint:
    return TensorPrint(name, shape, "float32", layout, fp(seed, constant), extra or {})


def cp(point, rank, prints, step=0, world=2) -> Checkpoint:
    return Checkpoint(point, rank, world, 1000.0 + step, step, {p.name: p for p in prints})


def bcast(rank, seed, name, src=0):
    return tp(name, seed, extra={"src": src, "group": [0, 1], "time": 1000.0005})


def overwritten_run():
    """Rank 0 and 1 held different experts; a broadcast from rank 0 made them equal; the rest agreed."""
    out = {}
    for r in (0, 1):
        out[r] = [
            cp(POINT_BEFORE_BROADCAST, r, [bcast(r, 1.0, "embed.weight"), bcast(r, 5.0 + r, "moe.w_in")]),
            cp(POINT_PREPARED, r, [tp("embed.weight", 10.0 + r, layout=FSDP), tp("moe.w_in", 5.0)]),
        ]
    return out


def test_replicated_dtensor_that_differs_is_reported():
    check = check_params({r: [cp(POINT_PREPARED, r, [tp("head.weight", 1.0 + r, layout=REPL)])] for r in (0, 1)}, {})
    (f,) = check.findings
    assert (f.kind, f.name, f.point, f.differing) == (REPLICATED_DIFFERS, "head.weight", "prepared", (1,))
    assert check.pattern is None


def test_plain_param_that_diverges_after_a_step_is_reported_at_that_step():
    check = check_params({r: [cp(POINT_PREPARED, r, [tp("w", 1.0)]),
                              cp(POINT_STEP, r, [tp("w", 2.0 + r)], step=1)] for r in (0, 1)}, {})
    (f,) = check.findings
    assert (f.kind, f.point) == (REPLICATED_DIFFERS, "step 1")


def test_identical_shards_of_a_dtensor_are_reported_but_not_constant_ones():
    prints = {r: [cp(POINT_PREPARED, r, [tp("moe.w_in", 3.0, layout=EP),
                                         tp("norm.weight", 0.0, layout=FSDP, constant=True)])] for r in (0, 1)}
    check = check_params(prints, {})
    assert [(f.kind, f.name) for f in check.findings] == [(SHARD_IDENTICAL, "moe.w_in")]
    assert check.pattern == PATTERN


def test_distinct_shards_and_equal_replicas_are_consistent():
    check = check_params({r: [cp(POINT_PREPARED, r, [tp("a", 1.0 + r, layout=FSDP), tp("b", 2.0, layout=REPL),
                                                     tp("c", 3.0)])] for r in (0, 1)}, {})
    assert check.findings == [] and not check.problem_found


def test_per_rank_plain_params_never_broadcast_are_left_alone():
    check = check_params({r: [cp(POINT_PREPARED, r, [tp("expert", 1.0 + r)]),
                              cp(POINT_STEP, r, [tp("expert", 5.0 + r)], step=1)] for r in (0, 1)}, {})
    assert check.findings == []
    assert any("per-rank by construction" in n for n in check.notes)


def test_overwritten_by_broadcast_is_attributed_to_the_recorded_broadcast():
    a, b = ranks(2)
    for builder in (a, b):
        builder.coll("broadcast", (2, 4), root=0, line=84)  # embed.weight
        builder.coll("broadcast", (2, 4), root=0, line=84)  # moe.w_in
        builder.coll("all_reduce", (2, 4), line=99)  # not a broadcast
    check = check_params(overwritten_run(), {0: a.events, 1: b.events})
    (f,) = check.findings
    assert (f.kind, f.name, f.ranks) == (SHARD_IDENTICAL, "moe.w_in", (0, 1))
    assert f.overwrite is not None
    assert (f.overwrite.op, f.overwrite.src, f.overwrite.call_site) == ("broadcast", 0, "train.py:84")
    assert check.pattern == PATTERN


def test_overwrite_without_a_trace_still_names_source_rank():
    (f,) = check_params(overwritten_run(), {}).findings
    assert f.overwrite is not None and f.overwrite.src == 0 and f.overwrite.call_site is None


def test_every_parameter_differing_before_the_broadcast_is_the_usual_sync_not_claimed():
    run = {r: [cp(POINT_BEFORE_BROADCAST, r, [bcast(r, 1.0 + r, "embed.weight"), bcast(r, 5.0 + r, "moe.w_in")]),
               cp(POINT_PREPARED, r, [tp("embed.weight", 1.0), tp("moe.w_in", 5.0)])] for r in (0, 1)}
    check = check_params(run, {})
    assert check.findings == [] and check.pattern is None
    assert any("not claimed" in n for n in check.notes)


def test_empty_ranks_waiting_for_rank_0_are_not_a_difference():
    """Ranks other than the source hold zeros (to_empty / meta init) before the broadcast."""
    run = {0: [cp(POINT_BEFORE_BROADCAST, 0, [bcast(0, 1.0, "e"), bcast(0, 5.0, "w")]),
               cp(POINT_PREPARED, 0, [tp("e", 1.0), tp("w", 5.0)])],
           1: [cp(POINT_BEFORE_BROADCAST, 1, [bcast(1, 1.0, "e"), tp("w", 0.0, constant=True,
                                                                       extra={"src": 0, "group": [0, 1]})]),
               cp(POINT_PREPARED, 1, [tp("e", 1.0), tp("w", 5.0)])]}
    assert check_params(run, {}).findings == []


def test_optimizer_state_that_differs_where_the_param_agrees():
    run = {r: [cp(POINT_PREPARED, r, [tp("w", 1.0)]),
               cp(POINT_STEP, r, [tp("w", 2.0), tp("w#exp_avg", 3.0 + r)], step=1)] for r in (0, 1)}
    (f,) = check_params(run, {}).findings
    assert (f.kind, f.name, f.point) == (STATE_DIFFERS, "w#exp_avg", "step 1")


def test_missing_rank_data_is_said_and_compared_without_it():
    run = {r: [cp(POINT_PREPARED, r, [tp("w", 1.0 + r)], world=3)] for r in (0, 1)}
    run[0][0].tensors["x"] = tp("x", 1.0, layout=REPL)
    run[1][0].tensors["x"] = tp("x", 2.0, layout=REPL)
    check = check_params(run, {})
    assert any("no fingerprints from rank(s) 2" in n for n in check.notes)
    assert [f.name for f in check.findings] == ["x"]
    assert check_params({0: run[0]}, {}).findings == []


def test_layout_groups_of_a_2d_mesh():
    layout = Layout((0, 1, 2, 3), (2, 2), ("R", "S0"))
    assert layout.groups(1) == [("R", (1, 3)), ("S0", (0, 1))]
    assert layout.groups(5) == []


def test_file_round_trip_and_a_bad_line(tmp_path):
    folder = tmp_path / "params"
    folder.mkdir()
    for r in (0, 1):
        tensors = [["moe.w_in", [2, 4], "float32", {"mesh": [0, 1], "shape": [2], "placements": ["S0"]},
                    list(fp(3.0)), {}]]
        (folder / f"rank-{r}.jsonl").write_text(encode(POINT_PREPARED, r, 2, 1.0, 0, tensors) + "{not json\n")
    check = check_run_dir(tmp_path)
    assert [f.name for f in check.findings] == ["moe.w_in"]
    assert any("unreadable" in n for n in check.notes)
    assert json.loads(json.dumps(check.to_json()))["pattern"] == PATTERN
    assert decode(encode(POINT_STEP, 0, 2, 1.0, 3, [])).step == 3


def test_plain_param_outside_fsdp2_is_claimed_with_a_lower_score_when_everything_differed_before():
    """Every rank initialized on its own; a rank-0 loader broadcast everything. The plain parameter
    kept out of FSDP2 (``ignored_params``) while the others are its shards was per-rank data."""
    run = {r: [cp(POINT_BEFORE_BROADCAST, r, [bcast(r, 1.0 + r, "dense.weight"), bcast(r, 5.0 + r, "experts")]),
               cp(POINT_PREPARED, r, [tp("dense.weight", 1.0 + r, layout=FSDP), tp("experts", 5.0)])] for r in (0, 1)}
    (f,) = check_params(run, {}).findings
    assert (f.kind, f.name, f.confidence) == (SHARD_IDENTICAL, "experts", 0.6)
    assert "kept out of FSDP2" in f.evidence


def test_a_bucket_broadcast_is_attributed_by_each_ranks_own_time():
    """DDP's constructor broadcasts a flattened bucket: no parameter shape, so the broadcast right
    after the rank's own pre-broadcast time is taken, not a later one of another shape."""
    a, b = ranks(2)  # clocks: a from 1000.000, b from 1000.000; the prints' times differ per rank
    for builder in (a, b):
        builder.coll("broadcast", (609,), root=0, line=77)  # the bucket, at 1000.001
        builder.coll("broadcast", (8,), root=0, line=84)  # a later forward's broadcast, at 1000.002
    run = {}
    for r, when in ((0, 1000.0015), (1, 1000.0002)):  # rank 0 records later than rank 1 issues
        extra = {"src": 0, "group": [0, 1], "time": when}
        run[r] = [cp(POINT_BEFORE_BROADCAST, r, [tp("dense", 1.0, extra=extra), tp("experts", 5.0 + r, extra=extra)]),
                  cp(POINT_PREPARED, r, [tp("dense", 1.0), tp("experts", 5.0)])]
    (f,) = check_params(run, {0: a.events, 1: b.events}).findings
    assert f.overwrite is not None and f.overwrite.call_site == "train.py:77", f.overwrite


def _empty_rank_load(experts_broadcast: bool):
    """Rank 0 loads the checkpoint, rank 1 holds empty weights (zeros in the dense norm, garbage
    elsewhere) and receives everything by broadcast; expert weights get no gradient averaging."""
    out = {}
    for r in (0, 1):
        before = [bcast(r, 1.0 + 7 * r, "embed.weight"),
                  tp("norm.bias", 0.0, constant=True, extra={"src": 0, "group": [0, 1], "time": 1000.0005})]
        if experts_broadcast:
            before.append(bcast(r, 5.0 + 7 * r, "moe.experts.0.w"))
        expert = 5.0 if experts_broadcast else 5.0 + r
        out[r] = [
            cp(POINT_BEFORE_BROADCAST, r, before),
            cp(POINT_PREPARED, r, [tp("embed.weight", 1.0), tp("norm.bias", 0.0, constant=True),
                                   tp("moe.experts.0.w", expert)]),
            cp(POINT_STEP, r, [tp("embed.weight", 1.5), tp("norm.bias", 0.2), tp("moe.experts.0.w", 6.0 + r)], step=1),
        ]
    return out


def test_a_broadcast_parameter_that_the_job_then_leaves_out_of_sync_was_per_rank_and_overwritten():
    check = check_params(_empty_rank_load(experts_broadcast=True), {})
    (f,) = check.findings
    assert (f.kind, f.name, f.point, f.confidence) == (SHARD_IDENTICAL, "moe.experts.0.w", "prepared", 0.6)
    assert "different again at step 1 while 2 other broadcast parameter(s) are still identical" in f.evidence
    assert f.overwrite is not None and f.overwrite.src == 0
    assert check.pattern == PATTERN


def test_the_same_job_with_its_experts_kept_out_of_the_broadcast_is_consistent():
    """A zero tensor on the empty rank agreeing with rank 0's zeros is not a parameter that 'already
    agreed': without that rule every broadcast parameter here would be claimed at 0.85."""
    check = check_params(_empty_rank_load(experts_broadcast=False), {})
    assert check.findings == [] and check.pattern is None


def test_constant_parameters_beside_per_rank_ones_are_per_rank_too():
    """A pipeline stage's LayerNorm is ones and zeros on every stage at first, then trains apart."""
    run = {r: [cp(POINT_PREPARED, r, [tp("blocks.0.attn.w", 1.0 + r), tp("blocks.0.norm.weight", 1.0, constant=True),
                                      tp("head.norm.weight", 1.0, constant=True)]),
               cp(POINT_STEP, r, [tp("blocks.0.attn.w", 3.0 + r), tp("blocks.0.norm.weight", 2.0 + r),
                                  tp("head.norm.weight", 2.0 + r)], step=1)] for r in (0, 1)}
    check = check_params(run, {})
    # head.norm shares no module with a per-rank parameter: still taken as replicated
    assert [(f.kind, f.name) for f in check.findings] == [(REPLICATED_DIFFERS, "head.norm.weight")]
    assert any("ones or zeros" in n for n in check.notes)
