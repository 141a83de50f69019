"""The native recording kernel (``moedoctor/recorder/native``) against the Python one, in one process on
the ``fake`` backend: the same records byte for byte (but times and the inline reduce op), counters
handed over when the kernels are switched, the event cap, and the fallback where it cannot build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_OPS = REPO / "tests" / "jobs" / "fake_ops.py"


@pytest.fixture(scope="module")
def native_built():
    """Build the extension once (into TORCH_EXTENSIONS_DIR) or skip, saying why."""
    from moedoctor.recorder import native

    if not native.available():
        pytest.skip(f"native recorder extension cannot be built here: {native.reason[-400:]}")


def run_fake_ops(run_dir: Path, kernels: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **env)
    result = subprocess.run([sys.executable, str(FAKE_OPS), str(run_dir), "--kernels", kernels, *args],
                            capture_output=True, text=True, timeout=300, env=environment, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "traces" / "rank-00000.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def comparable(recs: list[dict]) -> list[dict]:
    """Records without times, nor the name of the kernel that wrote them (the coverage record's
    ``kernel``); c10d reduce ops dropped (Python writes them as later ``a`` records)."""
    out = []
    for rec in recs:
        if rec["k"] == "a":
            continue
        rec = {k: v for k, v in rec.items() if k not in ("t", "kernel")}
        if rec["k"] == "c" and rec["raw"].startswith("c10d::"):
            rec.pop("red", None)
        out.append(rec)
    return out


def test_native_records_match_python_records(native_built, tmp_path):
    python = run_fake_ops(tmp_path / "python", "python")
    native = run_fake_ops(tmp_path / "native", "native")
    assert "native=False" in python.stdout and "native=True" in native.stdout
    # On 3.11 and 3.12 the kernel walks CPython's own frames (and checked that it sees what the
    # frame-object walk sees): the records below are then the fast walk's.
    assert ("fast_walk=True" in native.stdout) == (sys.version_info[:2] in ((3, 11), (3, 12))), native.stdout
    py_recs, native_recs = records(tmp_path / "python"), records(tmp_path / "native")
    assert comparable(py_recs) == comparable(native_recs)

    collectives = [r for r in native_recs if r["k"] == "c"]
    assert not [r for r in native_recs if r["k"] == "e" and r["kind"] == "recorder_error"]
    # The reduce op is inline for every native record, and agrees with the Python annotations.
    annotations = {r["i"]: r["red"] for r in py_recs if r["k"] == "a"}
    for rec in collectives:
        if rec["op"] in ("all_reduce", "reduce_scatter", "all_reduce_coalesced"):
            assert rec["red"] in ("sum", "max", "avg")
            assert annotations.get(rec["i"], rec["red"]) == rec["red"]
    assert {r["red"] for r in collectives if "red" in r} == {"sum", "max", "avg"}
    # What the fake_ops job exercises, as the native kernel saw it.
    assert {r["ph"] for r in collectives} == {"other", "forward", "optimizer", "checkpoint_load",
                                              "checkpoint_save", "backward"}
    assert {r["th"] for r in collectives} == {"MainThread", "worker-thread"}
    assert any(r.get("n") == [1, 70] for r in collectives)
    assert any(r["dt"] == ["bfloat16"] for r in collectives)
    sends = [r for r in collectives if r["op"] == "send"]
    assert [(r["peer"], r["pseq"]) for r in sends] == [(1, 1), (1, 1)]  # group rank 0 of [1, 0] is rank 1
    assert {r["raw"] for r in collectives} >= {"c10d::allreduce_", "_c10d_functional::all_reduce",
                                               "c10d::_allgather_base_", "c10d::alltoall_base_", "c10d::barrier"}


def test_both_kernels_write_what_the_schema_says(native_built, tmp_path):
    """The C++ writer cannot import moedoctor.trace.schema: its every record kind, and every key of the
    collective record, is checked against the schema here (the Python writer's too)."""
    from moedoctor.trace import schema

    for kernels, extra in (("native", ()), ("python", ()), ("native", ("--max-events", "5"))):
        run_dir = tmp_path / f"{kernels}{len(extra)}"
        run_fake_ops(run_dir, kernels, *extra)
        lines = (run_dir / "traces" / "rank-00000.jsonl").read_text().splitlines()
        recs = [json.loads(line) for line in lines]
        assert schema.problems(recs[0]) == []
        bad = {line: schema.problems(rec) for line, rec in zip(lines[1:], recs[1:], strict=True) if schema.problems(rec)}
        assert not bad, bad
        kinds = {r["k"] for r in recs[1:]}
        assert kinds >= {"g", "s", "c", "e", "v"} | ({"cap"} if extra else set()), kinds  # fake works never complete: no "d"
        if not extra:
            keys = set().union(*(r for r in recs[1:] if r["k"] == "c"))
            assert keys == {"k"} | {k.key for k in schema.COLLECTIVE.keys}, keys


def test_switching_kernels_hands_the_counters_over(native_built, tmp_path):
    result = run_fake_ops(tmp_path / "switch", "switch")
    assert "switched native=True" in result.stdout
    recs = records(tmp_path / "switch")
    collectives = [r for r in recs if r["k"] == "c"]
    assert [r["i"] for r in collectives] == list(range(len(collectives)))
    for kind in ("g", "s"):
        ids = [r["id"] for r in recs if r["k"] == kind]
        assert ids == list(range(len(ids))), f"{kind} ids {ids}"
    seqs: dict[int, list] = {}
    for rec in collectives:
        if "pseq" not in rec:
            seqs.setdefault(rec["g"], []).append(rec["seq"])
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values()), seqs
    pairs = [(r["g"], r["peer"], r["pseq"]) for r in collectives if "pseq" in r]
    assert pairs[-1] == (1, 1, 2)  # written by the Python kernels again, after the native ones
    coverage = [r for r in recs if r["k"] == "v"][-1]
    by_group = {gid: sum(1 for r in collectives if r["g"] == gid) for gid in seqs}
    names = {r["id"]: r["name"] for r in recs if r["k"] == "g"}
    assert {name: n for name, n, _ in coverage["groups"]} == {names[g]: n for g, n in by_group.items()}


def test_native_event_cap(native_built, tmp_path):
    run_fake_ops(tmp_path / "cap", "native", "--max-events", "5")
    recs = records(tmp_path / "cap")
    assert len([r for r in recs if r["k"] == "c"]) == 5
    assert len([r for r in recs if r["k"] == "cap"]) == 1
    coverage = [r for r in recs if r["k"] == "v"][-1]
    recorded = sum(n for _, n, _ in coverage["groups"])
    assert coverage["dropped"] == recorded - 5 > 0


def test_falls_back_to_python_kernels_when_it_cannot_build(tmp_path):
    result = run_fake_ops(tmp_path / "fallback", "native", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
                          CXX=str(tmp_path / "no-such-compiler"))
    assert "native=False" in result.stdout
    assert "native kernel unavailable" in result.stderr
    assert len([r for r in records(tmp_path / "fallback") if r["k"] == "c"]) > 10


def test_available_never_raises(tmp_path):
    code = ("from moedoctor.recorder import native; ok = native.available(); "
            "assert ok or native.reason, 'no reason'; print(ok, native.reason[:200])")
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PATH="/nonexistent")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("False")  # neither ninja nor a compiler on PATH
