"""Level 2's declarations (each ``moedoctor.analysis.patterns`` module's ``DECLARATION``): every pattern declares the
mechanisms it refines and the domain evidence it needs, and its classifier reads nothing else.

The classifiers run against a ``RunView`` proxy that records each domain accessor it is asked for
(recorder evidence kinds, stacks, process states, exceptions, exit statuses, step discards), on
every factory-built scenario; what they read must be in their declaration's ``reads``.
"""

from __future__ import annotations

import pytest
from analysis_scenarios import SCENARIOS, units_skipped
from pathlib import Path

from event_factory import ranks, run_of

from moedoctor.analysis import analyze, load_run
from moedoctor.analysis.mechanisms.culprits import find_culprits
from moedoctor.analysis.patterns import declarations, missing
from moedoctor.analysis.patterns.base import BUSY, EXCEPTION, EXITS, PROCESS, STACKS, STEPS
from moedoctor.analysis.diagnosis import _hang, _primary
from moedoctor.analysis.matching import all_divergences
from moedoctor.analysis.mechanisms.wording import suggestion
from moedoctor.analysis.mechanisms.vocabulary import Mechanism
from moedoctor.analysis.mechanisms.detection import mechanism_of
from moedoctor.analysis.patterns import registry
from moedoctor.analysis.patterns.base import Context
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.waitfor import find_cycle, wait_edges
from moedoctor.events import Phase

DOMAIN = STACKS | PROCESS | EXCEPTION | EXITS | STEPS | BUSY
#: Runs recorded by ``moedoctor run`` from the fixtures (``tests/golden``), beside the factory scenarios.
GOLDEN = Path(__file__).resolve().parent.parent / "golden"
RECORDED = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").exists())


def _run(name: str):
    return load_run(GOLDEN / name[len("golden:") :]) if name.startswith("golden:") else SCENARIOS[name][0]()


RUNS = sorted(SCENARIOS) + [f"golden:{n}" for n in RECORDED]


class RecordingView:
    """A ``RunView`` that records the domain evidence asked of it."""

    def __init__(self, view: RunView):
        self._view, self.read = view, set()

    def evidence(self, rank, kind=None, step=None):
        self.read.add(f"evidence:{kind or '*'}")
        return self._view.evidence(rank, kind, step)

    def __getattr__(self, name):
        if name in DOMAIN:
            self.read.add(name)
        return getattr(self._view, name)


def _context(run, recording: RecordingView | None = None) -> tuple[Context, object]:
    view = RunView(run)
    divs, edges = all_divergences(view), wait_edges(view)
    cycle = find_cycle(edges)
    primary = _primary(view, divs, edges, cycle, _hang(view, edges))
    culprits = find_culprits(view, primary, edges, cycle)
    mech = mechanism_of(view, primary, culprits, edges, cycle)
    return Context(recording or view, primary, culprits, edges, cycle, _hang(view, edges)), mech


def test_every_pattern_declares_itself():
    assert {p.id for p in registry()} == set(declarations())
    for decl in declarations().values():
        assert decl.refines, decl.pattern


@pytest.mark.parametrize("scenario", RUNS)
@pytest.mark.parametrize("pattern", [p.id for p in registry()])
def test_a_classifier_reads_only_what_it_declares(scenario, pattern):
    run = _run(scenario)
    recording = RecordingView(RunView(run))
    ctx, mech = _context(run, recording)
    next(p for p in registry() if p.id == pattern).classify(ctx)
    undeclared = recording.read - declarations()[pattern].reads
    assert not undeclared, f"{pattern} read {sorted(undeclared)} on {scenario}, not in its declaration"


@pytest.mark.parametrize("scenario", RUNS)
@pytest.mark.parametrize("pattern", sorted(declarations()))
def test_a_requirement_reads_only_its_patterns_declaration(scenario, pattern):
    run = _run(scenario)
    recording = RecordingView(RunView(run))
    ctx, mech = _context(run, recording)
    for req in declarations()[pattern].requires:
        req.holds(ctx, mech)
    assert not recording.read - declarations()[pattern].reads


EXPECTED = {
    "skipped-optimizer-step": Mechanism.SKIPPED_COLLECTIVE,  # the history puts the clip first: left out
    "microbatch-count-mismatch": Mechanism.LOOP_TRIP_COUNT,
    "rank-conditional-collective": Mechanism.EXTRA_COLLECTIVE,
    "collective-order-inversion": Mechanism.WAIT_CYCLE,
    "shape-mismatch": Mechanism.DIFFERENT_SHAPE,
    "inactive-experts": Mechanism.DIFFERENT_SHAPE,
    "straggler": Mechanism.RANK_OUTSIDE,
    "rank-stopped": Mechanism.RANK_OUTSIDE,
    "not-a-desync": Mechanism.TRANSPORT_HANG,
}


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_each_scenario_has_its_mechanism_and_keeps_its_pattern(scenario):
    build, culprits, _ = SCENARIOS[scenario]
    report = analyze(build())
    assert report.mechanism is not None and report.mechanism.mechanism == EXPECTED[scenario], report.mechanism
    assert report.pattern == scenario and report.culprit_ranks == culprits, report.not_named


RECORDED_MECHANISMS = {
    "hardware_like": (Mechanism.TRANSPORT_HANG, "rank-stopped"),  # stopped inside the collective
    "inactive_experts": (Mechanism.DIFFERENT_SHAPE, "inactive-experts"),
    "inflight_metric_allreduce": (Mechanism.LOOP_TRIP_COUNT, "inflight-metric-allreduce"),  # a unit loop
    "skipped_optimizer_step": (Mechanism.SKIPPED_COLLECTIVE, "skipped-optimizer-step"),  # the clip left out
    "straggler": (Mechanism.RANK_OUTSIDE, "straggler"),
    "uneven_dtensor_allgather": (Mechanism.EXTRA_COLLECTIVE, "uneven-dtensor-allgather"),  # the save's next one
    "healthy": (None, None),
}


@pytest.mark.parametrize("name", sorted(RECORDED_MECHANISMS))
def test_recorded_runs_keep_their_pattern_and_show_their_mechanism(name):
    report = analyze(load_run(GOLDEN / name))
    mech, pattern = RECORDED_MECHANISMS[name]
    assert (report.mechanism.mechanism if report.mechanism else None) == mech, report.mechanism
    assert report.pattern == pattern, report.not_named


def _per_microbatch_loop(counts: dict[int, int], checkpoint: bool = False):
    """Two ranks all-reduce once per micro-batch (h.py:14), then the step's loss (h.py:20); at step 1
    they run ``counts`` micro-batches. ``checkpoint``: the loop is a checkpoint save's per-key loop."""
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            n = counts[r.rank] if step == 1 else 3
            phase = Phase.CHECKPOINT_SAVE if checkpoint and step == 1 else Phase.BACKWARD
            for _ in range(n):
                r.ev("backward_begin", step)
                r.coll("all_reduce", (64,), phase=phase, step=step, line=14, file="/job/h.py",
                       done=step == 0 or r.rank == 0 or _ < n - 1)
                r.ev("backward_end", step)
            if step == 0:
                r.coll("all_reduce", (1,), phase=Phase.OTHER, step=step, line=20, file="/job/h.py")
    a.coll("all_reduce", (1,), phase=Phase.OTHER, step=1, line=20, file="/job/h.py", done=False)
    return run_of(a, b, hang=True)


def test_a_plain_loop_with_uneven_trip_counts_is_never_a_checkpoint_pattern():
    report = analyze(_per_microbatch_loop({0: 15, 1: 16}))
    mech = report.mechanism
    assert mech.mechanism == Mechanism.LOOP_TRIP_COUNT and mech.counts == {0: 15, 1: 16}, mech
    assert report.pattern != "uneven-dtensor-allgather"
    assert "rank 0 ran 15, rank 1 ran 16 iterations of h.py:14" in suggestion(mech).text
    if report.pattern in (None, "unknown-desync"):
        assert "rank 0 ran 15, rank 1 ran 16 iterations of h.py:14" in report.suggestion.text


def test_the_checkpoint_pattern_names_the_same_loop_inside_a_save():
    run = _per_microbatch_loop({0: 15, 1: 16}, checkpoint=True)
    ctx, mech = _context(run)
    assert missing("uneven-dtensor-allgather", ctx, mech) == []
    ctx, mech = _context(_per_microbatch_loop({0: 15, 1: 16}))
    (lacks,) = missing("uneven-dtensor-allgather", ctx, mech)
    assert lacks.startswith("a checkpoint save or load") and "gathers outside the training passes" in lacks


def _unit_loop(skip_unit_on_rank1: bool, phase=Phase.FORWARD, module: bool = True):
    """Per-expert units gathered one by one at moe.py:83 (4 experts); at step 1 rank 1 skips expert 3
    (idle) and goes on to the head's gather at moe.py:90, while rank 0 gathers expert 3."""
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            for e in range(4):
                if step == 1 and r.rank == 1 and e == 3 and skip_unit_on_rank1:
                    continue
                last = step == 1 and r.rank == 0 and e == 3
                r.coll("all_gather", (64,), phase=phase, step=step, line=83, file="/job/moe.py",
                       module=f"layers.0.experts.{e}" if module else None, done=not last)
            if step == 0 or r.rank == 1:
                r.coll("all_gather", (32,), phase=phase, step=step, line=90, file="/job/moe.py",
                       module="head" if module else None, done=step == 0)
    return run_of(a, b, hang=True)


def test_an_idle_expert_unit_left_out_of_a_gather_loop_is_never_a_checkpoint_pattern():
    report = analyze(_unit_loop(True))
    assert report.mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert report.pattern != "uneven-dtensor-allgather"
    assert "uneven-dtensor-allgather" in report.not_named or all(
        c.pattern != "uneven-dtensor-allgather" for c in report.candidates
    )


def test_a_gather_loop_outside_the_passes_of_no_unit_is_the_checkpoint_patterns_to_claim():
    ctx, mech = _context(_unit_loop(True, phase=Phase.OTHER, module=False))
    assert mech.mechanism == Mechanism.LOOP_TRIP_COUNT
    assert missing("uneven-dtensor-allgather", ctx, mech) == []


def _two_microbatches(rank0_syncs_in_step1: bool, rank1_third_pass: bool = False):
    """Two micro-batches per step: forward all-gather (train.py:20) before each backward, a metric
    all-reduce after each backward (train.py:102), gradient buckets in the second backward pass
    (train.py:56). In step 1 rank 0 syncs in its second backward; rank 1 either issues its metric
    after the same second pass (its buckets held back: the same micro-batch) or, with
    ``rank1_third_pass``, begins a third micro-batch's forward."""
    a, b = ranks(2)

    def micro(r, step, sync, metric=True, done=True):
        r.coll("all_gather", (64,), phase=Phase.FORWARD, step=step, line=20)
        r.ev("backward_begin", step=step)
        if sync:
            r.coll("all_reduce", (1088,), phase=Phase.BACKWARD, step=step, line=56, done=done)
        r.ev("backward_end", step=step)
        if metric:
            r.coll("all_reduce", (1,), step=step, line=102, done=done)

    for r in (a, b):
        micro(r, 0, False)
        micro(r, 0, True)
        micro(r, 1, False)
    a.coll("all_gather", (64,), phase=Phase.FORWARD, step=1, line=20)
    a.ev("backward_begin", step=1)
    a.coll("all_reduce", (1088,), phase=Phase.BACKWARD, step=1, line=56, done=False)
    b.coll("all_gather", (64,), phase=Phase.FORWARD, step=1, line=20)
    b.ev("backward_begin", step=1)
    b.ev("backward_end", step=1)
    if rank1_third_pass:
        b.coll("all_gather", (64,), phase=Phase.FORWARD, step=1, line=20, done=False)
    else:
        b.coll("all_reduce", (1,), step=1, line=102, done=False)
    return run_of(a, b, hang=True)


def test_a_metric_after_the_same_backward_pass_is_not_another_micro_batch():
    """Rank 1 ran as many backward passes as rank 0 and issued the metric that follows each pass:
    the ranks are in the same micro-batch, so microbatch-count-mismatch's evidence is missing and
    the pattern is not named (the loop-trip-count reading is not the mechanism either)."""
    report = analyze(_two_microbatches(True))
    assert report.pattern != "microbatch-count-mismatch", report.pattern
    assert report.mechanism.mechanism != Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert any("different micro-batches" in n for n in report.not_named.get("microbatch-count-mismatch", []))


def test_a_rank_that_begins_another_pass_is_in_another_micro_batch():
    report = analyze(_two_microbatches(True, rank1_third_pass=True))
    assert report.mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert "microbatch-count-mismatch" not in report.not_named


def test_module_list_members_left_out_in_forward_are_inactive_experts():
    report = analyze(units_skipped("moe.experts."))
    assert report.mechanism.mechanism == Mechanism.SKIPPED_COLLECTIVE
    assert report.pattern == "inactive-experts" and report.culprit_ranks == [1], report.not_named
    assert any("moe.experts.0, moe.experts.1" in e for e in report.evidence)


def test_units_that_are_no_module_list_members_left_out_are_not_inactive_experts():
    report = analyze(units_skipped("head_"))  # head_0, head_1: no indexed member of a module list
    assert report.mechanism.mechanism == Mechanism.SKIPPED_COLLECTIVE
    assert report.pattern != "inactive-experts", report.summary


def _token_budget(rank1_passes: int):
    """Per-micro-batch gradient all-reduces (train.py:90, two parameters) after each backward pass;
    after the optimizer step (its hook moves the step counter on) a loss all-reduce (train.py:95).
    Step 0: two micro-batches on both ranks; step 1: rank 0 runs two, rank 1 ``rank1_passes``."""
    a, b = ranks(2)

    def micro(r, step, done=True):
        r.ev("backward_begin", step=step)
        r.ev("backward_end", step=step)
        r.coll("all_reduce", (50, 16), step=step, line=90, done=done)
        if done:
            r.coll("all_reduce", (16,), step=step, line=90)

    for r in (a, b):
        micro(r, 0)
        micro(r, 0)
        r.ev("optimizer_step_begin", step=0)
        r.coll("all_reduce", (1,), step=1, line=95)
        micro(r, 1)
        micro(r, 1)
    a.ev("optimizer_step_begin", step=1)
    a.coll("all_reduce", (1,), step=2, line=95, done=False)
    for _ in range(rank1_passes - 3):
        micro(b, 1)
    micro(b, 1, done=False)
    return run_of(a, b, hang=True)


def test_a_rank_in_more_micro_batches_while_the_other_stepped_is_a_microbatch_count_mismatch():
    report = analyze(_token_budget(3))
    assert report.mechanism.mechanism == Mechanism.LOOP_TRIP_COUNT, report.mechanism
    assert report.pattern == "microbatch-count-mismatch" and report.culprit_ranks == [0], report.summary
