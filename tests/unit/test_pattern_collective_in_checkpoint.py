"""``collective-in-checkpointed-region`` on factory-built traces: a forward call site re-issued in
backward by one rank's checkpoint recompute against another rank's FSDP2 backward collective; the
same re-issue on every rank is healthy; without a stack dump or a repeated code path the pattern is
not claimed."""

from __future__ import annotations

from dataclasses import replace

from event_factory import TraceBuilder, ranks, run_of, stack

from moedoctor.analysis import analyze
from moedoctor.analysis.model import Verdict
from moedoctor.events import CallSite, Group, Phase

F, B, O = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER
JOB = "/job/ulysses.py"
GATHER = f"{JOB}:43 gather_position_ids"
FWD_STACK = (GATHER, f"{JOB}:87 forward", f"{JOB}:112 forward", f"{JOB}:149 main")
BWD_STACK = (GATHER, f"{JOB}:87 forward", f"{JOB}:153 main")
HELPER_BWD = (GATHER, f"{JOB}:210 backward")  # a helper shared by an autograd Function's backward
NAME = "collective-in-checkpointed-region"


def _gather(r: TraceBuilder, phase: Phase, step: int, frames: tuple[str, ...], done: bool = True,
            group: Group | None = None) -> None:
    r.coll("all_gather", (1, 8), dtype="int64", phase=phase, step=step, line=43, file=JOB,
           function="gather_position_ids", done=done, group=group)
    r.events[-1] = replace(r.events[-1], call_site=CallSite(JOB, 43, "gather_position_ids", frames))


def _step(r: TraceBuilder, step: int, bwd: tuple[str, ...] = BWD_STACK, last: bool = False,
          fwd: tuple[str, ...] = FWD_STACK) -> None:
    """One step of two checkpointed FSDP2 layers, each all-gathering position_ids in forward and in
    its recompute. ``last``: stop where rank 0 re-issues the gather of layer 1 (not completed)."""
    for unit in ("layers.0", "layers.1"):
        r.coll("all_gather", (1106,), phase=F, step=step, module=unit, line=112, file=JOB)
        _gather(r, F, step, fwd)
    r.coll("all_gather", (1106,), phase=B, step=step, module="layers.1", line=153, file=JOB)
    r.coll("all_gather", (1106,), phase=B, step=step, module="layers.0", line=153, file=JOB)
    for unit in ("layers.1", "layers.0"):
        if last and unit == "layers.1":
            if r.rank == 0:
                _gather(r, B, step, bwd, done=False)
            else:
                r.coll("reduce_scatter", (2212,), phase=B, step=step, module=unit, line=153, file=JOB,
                       reduce_op="avg", done=False)
            return
        _gather(r, B, step, bwd)
        r.coll("reduce_scatter", (2212,), phase=B, step=step, module=unit, line=153, file=JOB, reduce_op="avg")
    r.coll("all_reduce", (1,), phase=O, step=step, line=160, file=JOB)


def _recompute_stack(rank: int):
    return stack(rank, ("all_gather", "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 4287),
                 ("gather_position_ids", JOB, 43), ("DecoderLayer.forward", JOB, 87),
                 ("recompute_fn", "/usr/lib/python3/site-packages/torch/utils/checkpoint.py", 1688),
                 ("unpack_hook", "/usr/lib/python3/site-packages/torch/utils/checkpoint.py", 1183),
                 ("main", JOB, 153))


def _hang(bwd: tuple[str, ...] = BWD_STACK, steps: int = 2, dump: bool = True, fwd: tuple[str, ...] = FWD_STACK):
    a, b = ranks(2)
    for r in (a, b):
        for s in range(steps):
            _step(r, s, bwd, fwd=fwd)
        _step(r, steps, bwd, last=True, fwd=fwd)
    stacks = [_recompute_stack(0), stack(1, ("reduce_scatter_single", "/usr/lib/python3/site-packages/torch/"
                                            "distributed/distributed_c10d.py", 4943), ("main", JOB, 153))]
    return run_of(a, b, hang=True, stacks=stacks if dump else [])


def _candidate(report, pattern: str = NAME):
    return next((c for c in report.candidates if c.pattern == pattern), None)


def test_recompute_reissue_against_fsdp_reduce_scatter_is_named():
    report = analyze(_hang())
    assert report.pattern == NAME, (report.summary, [(c.pattern, c.score) for c in report.candidates])
    assert report.verdict == Verdict.DESYNC and report.culprit_ranks == [1]
    evidence = "\n".join(report.evidence)
    assert "rank 0 issued all_gather [[1, 8]] from ulysses.py:43 in backward (step 2)" in evidence
    assert "forward 2 times in that step" in evidence
    assert "rank 0's stack shows torch.utils.checkpoint recomputing" in evidence
    assert "out to ulysses.py:87 (forward)" in evidence
    assert "reduce_scatter [[2212]] in backward of FSDP unit layers.1" in evidence
    assert "in steps 0, 1 every rank issued it in forward" in evidence
    assert report.suggestion is not None and report.suggestion.call_site == f"{JOB}:43"
    assert "Hoist this collective out of the activation-checkpointed region" in report.suggestion.text


def test_at_step_zero_it_is_named_without_the_history():
    report = analyze(_hang(steps=0))
    assert report.pattern == NAME, (report.summary, [(c.pattern, c.score) for c in report.candidates])
    assert any("not established: no earlier step" in e for e in report.evidence)


def test_the_same_reissue_on_every_rank_is_healthy():
    a, b = ranks(2)
    for r in (a, b):
        for s in range(3):
            _step(r, s)
    report = analyze(run_of(a, b))
    assert report.verdict == Verdict.HEALTHY and report.pattern is None, report.summary


def test_without_stack_dump_the_repeated_code_path_still_names_it_with_a_note():
    report = analyze(_hang(dump=False))
    assert report.pattern == NAME, (report.summary, [(c.pattern, c.score) for c in report.candidates])
    assert any("not established: rank 0 has no stack dump" in e for e in report.evidence)
    assert _candidate(report).score < analyze(_hang()).candidates[0].score


def test_a_checkpointed_function_issuing_the_collective_itself_is_named_without_stack_dump():
    # The collective sits in the checkpointed function itself: forward reached it from the model's
    # forward, the recompute from autograd (on CPU the training loop's frame is beyond it, on a CUDA
    # autograd device thread nothing is).
    direct_fwd = (GATHER, f"{JOB}:112 forward", f"{JOB}:149 main")
    for bwd in ((GATHER, f"{JOB}:153 main"), (GATHER,)):
        report = analyze(_hang(bwd=bwd, fwd=direct_fwd, dump=False))
        assert report.pattern == NAME, (bwd, report.summary, [(c.pattern, c.score) for c in report.candidates])
        assert any("the function was entered from autograd" in e for e in report.evidence)


def test_a_helper_shared_by_forward_and_backward_code_is_not_claimed_without_a_recompute():
    # The backward issue comes from another caller (an autograd Function's backward) and no stack
    # dump shows torch.utils.checkpoint: nothing proves a recompute.
    report = analyze(_hang(bwd=HELPER_BWD, dump=False))
    assert report.pattern != NAME
    found = _candidate(report)
    assert found is None or found.score < 0.4
    if found is not None:
        assert any("neither the stack dump nor the call stacks show" in e for e in found.evidence)


def test_a_backward_only_call_site_is_not_a_recompute():
    # A gradient hook's all_gather, issued in backward only (never in forward), against FSDP2's
    # reduce-scatter: not this pattern.
    a, b = ranks(2)
    for r in (a, b):
        r.coll("all_gather", (1106,), phase=F, step=0, module="layers.0", line=112, file=JOB)
    a.coll("all_gather", (1, 8), dtype="int64", phase=B, step=0, line=77, file=JOB, done=False)
    b.coll("reduce_scatter", (2212,), phase=B, step=0, module="layers.0", line=153, file=JOB, done=False)
    report = analyze(run_of(a, b, hang=True, stacks=[_recompute_stack(0)]))
    assert _candidate(report) is None, report.summary


def test_a_cycle_across_the_sp_and_fsdp_groups_is_a_skipped_reissue_not_an_order_inversion():
    # The gather runs on a separate sequence-parallel group: rank 0 waits in it, rank 1 (whose
    # recompute skipped it) waits in FSDP2's reduce-scatter of layers.1 on the default group. A
    # wait-for cycle, but rank 1 already reduces a unit rank 0 has not reduced yet: it will never
    # issue the gather in this step.
    sp = Group("1", "sp", (0, 1))
    a, b = ranks(2)
    for r in (a, b):
        for s in range(3):
            for unit in ("layers.0", "layers.1"):
                r.coll("all_gather", (1106,), phase=F, step=s, module=unit, line=112, file=JOB)
                _gather(r, F, s, FWD_STACK, group=sp)
            r.coll("all_gather", (1106,), phase=B, step=s, module="layers.1", line=153, file=JOB)
            if s == 2:
                break
            for unit in ("layers.1", "layers.0"):
                _gather(r, B, s, BWD_STACK, group=sp)
                r.coll("reduce_scatter", (2212,), phase=B, step=s, module=unit, line=153, file=JOB, reduce_op="avg")
            r.coll("all_reduce", (1,), phase=O, step=s, line=160, file=JOB)
    _gather(a, B, 2, BWD_STACK, done=False, group=sp)
    b.coll("reduce_scatter", (2212,), phase=B, step=2, module="layers.1", line=153, file=JOB, reduce_op="avg",
           done=False)
    report = analyze(run_of(a, b, hang=True, stacks=[_recompute_stack(0)]))
    scores = {c.pattern: c.score for c in report.candidates}
    assert report.pattern == NAME, (report.summary, scores)
    assert scores[NAME] > scores.get("collective-order-inversion", 0) + 0.01
    evidence = "\n".join(report.evidence)
    assert "it waits in reduce_scatter [[2212]] #" in evidence and "of group 0 (default_pg)" in evidence
    assert "rank 1 already reduces the gradients of FSDP unit layers.1, which rank 0 has not reduced" in evidence


def test_a_rank_that_waits_in_no_collective_is_not_said_to_have_skipped_it():
    # Rank 1 completed its last collective and issued nothing since (a straggler in its data loader,
    # say): rank 0's recompute collective met nothing, so no skip is shown.
    a, b = ranks(2)
    for r in (a, b):
        for s in range(2):
            _step(r, s)
    _step(a, 2, last=True)
    for unit in ("layers.0", "layers.1"):
        b.coll("all_gather", (1106,), phase=F, step=2, module=unit, line=112, file=JOB)
        _gather(b, F, 2, FWD_STACK)
    b.coll("all_gather", (1106,), phase=B, step=2, module="layers.1", line=153, file=JOB)
    b.coll("all_gather", (1106,), phase=B, step=2, module="layers.0", line=153, file=JOB)
    report = analyze(run_of(a, b, hang=True, stacks=[_recompute_stack(0)]))
    assert report.pattern != NAME, report.summary
    found = _candidate(report)
    assert found is None or (found.score <= 0.35 and any("waits in no collective" in e for e in found.evidence))
