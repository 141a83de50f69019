"""Checks on recorded traces shared by the recorder tests (Python and native kernels) and the
fixture tests: one definition of what a correct recording of a job is."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from moedoctor.events import Phase
from moedoctor.trace.reader import read_traces

MIXED = Path(__file__).resolve().parent / "jobs" / "mixed_healthy.py"


def numbers(output: str) -> list[str]:
    """The per-step losses and final digests a job printed, for comparing runs bitwise."""
    return sorted(re.findall(r"\[rank \d\] (?:step \d+ loss [\d.]+ metric [\d.]+|final digest [0-9a-f]+)", output))


def assert_sequences_identical(traces) -> None:
    """Every process group's collective sequence is the same on each of its member ranks."""
    by_group: dict[str, dict[int, list]] = {}
    for trace in traces:
        for event in trace.events:
            if not event.is_p2p:
                by_group.setdefault(event.group.name, {}).setdefault(trace.rank, []).append(event.signature())
    assert by_group, "no collective recorded"
    for name, by_rank in by_group.items():
        members = next(t.groups[name].ranks for t in traces if name in t.groups)
        assert all(by_rank.get(r) == by_rank[members[0]] for r in members), \
            f"group {name} differs across ranks: {[len(by_rank.get(r, [])) for r in members]}"


def assert_complete_coverage(traces) -> None:
    for trace in traces:
        assert not trace.problems, trace.problems
        assert trace.coverage and trace.coverage[-1].complete, f"rank {trace.rank}: {trace.coverage}"
        assert {g.group for g in trace.coverage[-1].groups} >= {e.group.name for e in trace.events}
        assert not [e.data for e in trace.evidence if e.kind == "recorder_error"]


def assert_mixed_job_recorded(traces, nproc: int, steps: int, reduce_ops_always_known: bool) -> None:
    """What recording ``tests/jobs/mixed_healthy.py`` must show. The Python kernels know a c10d
    reduce op only when the collective was still running at a poll; the native kernel always."""
    assert [t.rank for t in traces] == list(range(nproc))
    assert_complete_coverage(traces)
    assert_sequences_identical(traces)
    rank0 = traces[0]
    raw_ops = Counter(e.raw_op for e in rank0.events)
    for op in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allgather_",
               "c10d::allreduce_", "c10d::broadcast_", "c10d::send", "_c10d_functional::all_reduce",
               "c10d::barrier"):
        assert raw_ops[op] > 0, f"{op} not recorded: {raw_ops}"
    assert any(e.op == "recv" and e.peer == 0 for e in traces[1].events)
    reductions = [e for e in rank0.events if e.op in ("all_reduce", "reduce_scatter")]
    assert {e.reduce_op for e in reductions} - {None} <= {"sum", "avg"}
    known = reductions if reduce_ops_always_known else [e for e in reductions if e.raw_op.startswith("_c10d_functional")]
    assert all(e.reduce_op for e in known)
    assert all(e.completed for e in rank0.events if e.raw_op.startswith("c10d"))
    assert {e.thread for e in rank0.events} >= {"MainThread", "metrics-thread"}
    assert {Phase.FORWARD, Phase.BACKWARD, Phase.CHECKPOINT_SAVE, Phase.OTHER} <= {e.phase for e in rank0.events}
    assert {e.module for e in rank0.events if e.phase == Phase.BACKWARD} >= {"0", "2"}
    assert all(e.call_site and e.call_site.file.endswith("mixed_healthy.py") for e in rank0.events)
    assert max(e.step for e in rank0.events) == steps
    kinds = Counter(e.kind for e in rank0.evidence)
    assert kinds["grad_norm"] == steps and kinds["backward_begin"] == 2 * steps and kinds["checkpoint_save_begin"] == 1
    assert all(e.data["finite"] for e in rank0.evidence if e.kind == "grad_norm")
    # The DDP reducer's all-reduce comes from C++, during backward.
    assert any(e.op == "all_reduce" and e.phase == Phase.BACKWARD and e.raw_op.startswith("c10d") for e in rank0.events)
    # clip_grad_norm_ on DTensor gradients issues a functional collective inside DTensor's dispatch.
    clip_line = next(i for i, line in enumerate(MIXED.read_text().splitlines(), 1) if "clip_grad_norm_(" in line)
    clip_ops = {e.raw_op for e in rank0.events if e.call_site.line == clip_line}
    assert clip_ops == {"_c10d_functional::all_reduce"}, clip_ops


def assert_aborted_rank_kept_its_collective(run_dir: Path, reduce_op: str | None = None) -> None:
    """``tests/jobs/size_mismatch_abort.py``: each rank's third collective is recorded with its own
    size, the aborted rank's included (written before Gloo aborted it)."""
    traces = {t.rank: t for t in read_traces(run_dir / "traces")}
    for rank, size in ((0, (4,)), (1, (1,))):
        third = [e for e in traces[rank].events if e.seq == 3]
        assert third and third[0].in_shapes == (size,), f"rank {rank}: {traces[rank].events}"
        if reduce_op is not None:
            assert third[0].reduce_op == reduce_op


def assert_capped_at(run_dir: Path, events: int) -> None:
    for trace in read_traces(run_dir / "traces"):
        assert trace.capped
        assert len(trace.events) == events
