"""The native recording kernel (``MOEDOCTOR_NATIVE=1``) on real torchrun jobs (Gloo, 2 ranks): the
guarantees of the Python recorder (tests/integration/test_recorder.py), the same trace as the Python
recorder record by record, records that survive an abort, and the event cap."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import fields
from pathlib import Path

import pytest

from moedoctor.events import Phase
from moedoctor.trace.reader import read_traces
from torchrun_util import REPO, assert_ok, recorded_env, run_command, torchrun_command

MIXED = REPO / "tests" / "jobs" / "mixed_healthy.py"
ABORT = REPO / "tests" / "jobs" / "size_mismatch_abort.py"
NPROC = 2


@pytest.fixture(scope="module")
def native_built():
    """Build the extension once, before the jobs start (their ranks then load it from the cache)."""
    from moedoctor.recorder import native

    if not native.available():
        pytest.skip(f"native recorder extension cannot be built here: {native.reason[-400:]}")


def run_mixed(tmp_path: Path, kernels: str):
    run_dir = tmp_path / f"run-{kernels}"
    # Checkpoint folders of the same length: all_gather_object sizes depend on the path.
    cmd = torchrun_command(MIXED, NPROC, "--steps", "2", "--checkpoint-dir", str(tmp_path / f"ckpt-{kernels}"))
    result = run_command(cmd, timeout=240, env=recorded_env(run_dir, MOEDOCTOR_NATIVE="1" if kernels == "natv" else "0"))
    assert_ok(result)
    return run_dir, result


def numbers(output: str) -> list[str]:
    return sorted(re.findall(r"\[rank \d\] (?:step \d+ loss [\d.]+ metric [\d.]+|final digest [0-9a-f]+)", output))


def assert_recorder_guarantees(traces) -> None:
    """The checks of test_recorder.test_mixed_job_is_recorded_completely_and_identically, native
    flavor: reduce ops are known for every reduction, not only the ones still running at a poll."""
    assert [t.rank for t in traces] == list(range(NPROC))
    for trace in traces:
        assert not trace.problems, trace.problems
        coverage = trace.coverage[-1]
        assert coverage.complete, f"rank {trace.rank}: {coverage}"
        assert {g.group for g in coverage.groups} >= {e.group.name for e in trace.events}
        assert not [e for e in trace.evidence if e.kind == "recorder_error"]
    groups: dict[str, dict[int, list]] = {}
    for trace in traces:
        for event in trace.events:
            if not event.is_p2p:
                groups.setdefault(event.group.name, {}).setdefault(trace.rank, []).append(event.signature())
    for name, by_rank in groups.items():
        members = next(t.groups[name] for t in traces if name in t.groups)
        sequences = [by_rank[r] for r in members.ranks]
        assert all(s == sequences[0] for s in sequences), f"group {name} differs across ranks"

    rank0 = traces[0]
    raw_ops = Counter(e.raw_op for e in rank0.events)
    for op in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allgather_",
               "c10d::allreduce_", "c10d::broadcast_", "c10d::send", "_c10d_functional::all_reduce",
               "c10d::barrier"):
        assert raw_ops[op] > 0, f"{op} not recorded: {raw_ops}"
    assert any(e.op == "recv" and e.peer == 0 for e in traces[1].events)
    reductions = [e for e in rank0.events if e.op in ("all_reduce", "reduce_scatter")]
    assert {e.reduce_op for e in reductions} <= {"sum", "avg"} and all(e.reduce_op for e in reductions)
    assert all(e.completed for e in rank0.events if e.raw_op.startswith("c10d"))
    assert {e.thread for e in rank0.events} >= {"MainThread", "metrics-thread"}
    assert {Phase.FORWARD, Phase.BACKWARD, Phase.CHECKPOINT_SAVE, Phase.OTHER} <= {e.phase for e in rank0.events}
    assert {e.module for e in rank0.events if e.phase == Phase.BACKWARD} >= {"0", "2"}
    assert all(e.call_site and e.call_site.file.endswith("mixed_healthy.py") for e in rank0.events)
    assert max(e.step for e in rank0.events) == 2
    assert any(e.op == "all_reduce" and e.phase == Phase.BACKWARD and e.raw_op.startswith("c10d") for e in rank0.events)
    clip_line = next(i for i, line in enumerate(MIXED.read_text().splitlines(), 1) if "clip_grad_norm_(" in line)
    assert {e.raw_op for e in rank0.events if e.call_site.line == clip_line} == {"_c10d_functional::all_reduce"}


def test_native_mixed_job_is_recorded_completely_and_like_python(native_built, tmp_path):
    native_dir, native_run = run_mixed(tmp_path, "natv")
    python_dir, python_run = run_mixed(tmp_path, "pyth")
    assert numbers(native_run.output) and numbers(native_run.output) == numbers(python_run.output)
    native_traces, python_traces = read_traces(native_dir / "traces"), read_traces(python_dir / "traces")
    assert_recorder_guarantees(native_traces)

    for nat, py in zip(native_traces, python_traces, strict=True):
        assert nat.groups == py.groups
        assert len(nat.events) == len(py.events), f"rank {nat.rank}"
        for n, p in zip(nat.events, py.events):
            for field in fields(n):
                name = field.name
                a, b = getattr(n, name), getattr(p, name)
                if name == "time":
                    continue
                if name == "completed":
                    a, b = a is not None, b is not None
                if name == "reduce_op" and b is None:  # Python knows a c10d one only if still running at a poll
                    continue
                assert a == b, f"rank {nat.rank} event {n.event_id}: {name} native {a!r} python {b!r}"
        assert [(g.group, g.recorded, g.backend) for g in nat.coverage[-1].groups] == \
            [(g.group, g.recorded, g.backend) for g in py.coverage[-1].groups]
        assert Counter(e.kind for e in nat.evidence) == Counter(e.kind for e in py.evidence)


def test_native_aborted_rank_keeps_the_collective_it_died_in(native_built, tmp_path):
    run_dir = tmp_path / "run"
    result = run_command(torchrun_command(ABORT, NPROC), timeout=90, env=recorded_env(run_dir, MOEDOCTOR_NATIVE="1"))
    assert result.returncode != 0, result.tail()
    traces = {t.rank: t for t in read_traces(run_dir / "traces")}
    for rank, size in ((0, (4,)), (1, (1,))):
        third = [e for e in traces[rank].events if e.seq == 3]
        assert third and third[0].in_shapes == (size,), f"rank {rank}: {traces[rank].events}"
        assert third[0].reduce_op == "sum"


def test_native_event_cap_stops_recording_and_says_so(native_built, tmp_path):
    run_dir = tmp_path / "run"
    env = recorded_env(run_dir, MOEDOCTOR_MAX_EVENTS="2", MOEDOCTOR_NATIVE="1")
    run_command(torchrun_command(ABORT, NPROC), timeout=90, env=env)
    for trace in read_traces(run_dir / "traces"):
        assert trace.capped
        assert len(trace.events) == 2
