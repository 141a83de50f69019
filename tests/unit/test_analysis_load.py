"""``load_run`` on real files: damaged, partial and foreign input gives a partial analysis flagged
``incomplete``, never a traceback; the streaming path agrees with the full load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from analysis_scenarios import SCENARIOS
from event_factory import encode_trace, ranks, write_traces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moedoctor.analysis import analyze, load_run
from moedoctor.analysis.loading.run_data import SourceKind
from moedoctor.errors import MoedoctorError
from moedoctor.render.json_report import report_to_dict

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def builders_of(name):
    """The scenario's builders (re-run its build with run_of captured)."""
    import analysis_scenarios as sc

    captured = {}
    real = sc.run_of

    def capture(*builders, **kw):
        captured["b"] = builders
        return real(*builders, **kw)

    sc.run_of = capture
    try:
        (sc.healthy if name == "healthy" else SCENARIOS[name][0])()
    finally:
        sc.run_of = real
    return captured["b"]


def test_folder_of_traces_round_trips_through_files(tmp_path):
    write_traces(tmp_path, *builders_of("skipped-optimizer-step"))
    run = load_run(tmp_path)
    assert run.kind == SourceKind.TRACES and run.ranks == [0, 1] and run.incomplete == []
    report = analyze(run)
    assert report.pattern == "skipped-optimizer-step" and report.culprit_ranks == [1]


def test_truncated_last_record_and_corrupt_lines_are_noted(tmp_path):
    write_traces(tmp_path, *builders_of("shape-mismatch"))
    f0, f1 = sorted(tmp_path.iterdir())
    f0.write_bytes(f0.read_bytes()[:-7])                       # killed mid-write
    lines = f1.read_bytes().splitlines(keepends=True)
    lines[5] = b'{"k":"c","i":garbage\n'
    lines[6] = b'{"k":"c","i":1,"g":0,"seq":"two","s":0}\n'   # valid JSON, wrong types
    f1.write_bytes(b"".join(lines))
    run = load_run(tmp_path)
    text = " ".join(run.incomplete)
    assert "last record truncated" in text and "corrupt record" in text
    analyze(run)


def test_missing_rank_file_and_unknown_version(tmp_path):
    builders = ranks(4)
    for b in builders:
        b.coll("all_reduce", (8,))
    write_traces(tmp_path, *builders)
    (tmp_path / "rank-00002.jsonl").unlink()
    f3 = tmp_path / "rank-00003.jsonl"
    lines = f3.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace('"version":1', '"version":7')
    f3.write_text("".join(lines))
    run = load_run(tmp_path)
    assert run.ranks == [0, 1]
    text = " ".join(run.incomplete)
    assert "version 7 is not supported" in text and "no trace of ranks 2-3" in text
    assert analyze(run).incomplete == run.incomplete


def test_foreign_file_and_duplicate_rank(tmp_path):
    write_traces(tmp_path, *builders_of("healthy"))
    (tmp_path / "rank-00009.jsonl").write_text("not a trace\n")
    shutil.copy(tmp_path / "rank-00000.jsonl", tmp_path / "rank-00005.jsonl")
    run = load_run(tmp_path)
    text = " ".join(run.incomplete)
    assert "rank-00009.jsonl: left out" in text and "rank 0 already read" in text


def test_empty_folder_and_missing_path_are_bad_input(tmp_path):
    with pytest.raises(MoedoctorError) as e:
        load_run(tmp_path)
    assert e.value.exit_code == 2 and "nothing to analyze" in e.value.message
    with pytest.raises(MoedoctorError):
        load_run(tmp_path / "nope")


def test_run_dir_without_traces_still_analyzed(tmp_path):
    """Stuck before init_process_group: no traces, but a manifest with a hang and the stacks."""
    (tmp_path / "stacks").mkdir()
    (tmp_path / "traces").mkdir()
    c10d = "/x/torch/distributed/distributed_c10d.py"
    for rank, frames in ((0, [{"name": "_store_based_barrier", "filename": c10d, "line": 1},
                              {"name": "main", "filename": "/job/train.py", "line": 3}]),
                         (1, [{"name": "stuck_elsewhere", "filename": "/job/train.py", "line": 9},
                              {"name": "main", "filename": "/job/train.py", "line": 4}])):
        (tmp_path / "stacks" / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "pid": 10 + rank, "threads": [{"thread_name": "MainThread", "os_thread_id": 10 + rank,
                                                        "frames": frames}]}))
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "moedoctor-manifest", "status": "hang", "world_size": 2,
        "ranks": {"0": {"rank": 0, "host": "h", "pid": 10, "local_rank": 0, "exit_code": None, "source": "stopped"},
                  "1": {"rank": 1, "host": "h", "pid": 11, "local_rank": 1, "exit_code": None, "source": "stopped"}},
        "hang": {"detected_at": 1.0, "host": "h", "hang_timeout": 2.0, "idle_seconds": 2.0, "stopped": True,
                 "ranks": []}}))
    report = analyze(load_run(tmp_path))
    assert report.verdict.value == "stuck" and report.pattern == "straggler" and report.culprit_ranks == [1]
    assert "stuck_elsewhere" in " ".join(report.evidence)
    assert any("no trace files" in i for i in report.incomplete)


def test_damaged_manifest_stacks_and_gpu_are_noted(tmp_path):
    shutil.copytree(GOLDEN / "straggler", tmp_path / "run")
    run_dir = tmp_path / "run"
    (run_dir / "manifest.json").write_text("{broken")
    (run_dir / "stacks" / "rank-1.json").write_text("[]")
    (run_dir / "gpu" / "vm.json").write_text("42")
    run = load_run(run_dir)
    text = " ".join(run.incomplete)
    assert "manifest.json unreadable" in text and "stacks/rank-1.json unreadable" in text and "gpu/vm.json" in text
    report = analyze(run)
    assert report.culprit_ranks == [1]  # the traces still tell who never arrived


def test_flight_recorder_folder(tmp_path):
    data = Path(__file__).resolve().parent.parent / "data" / "flight_recorder" / "json"
    if not data.is_dir():
        pytest.skip("no Flight Recorder dumps in tests/data")
    run = load_run(data)
    assert run.kind == SourceKind.FLIGHT_RECORDER and run.incomplete
    report = analyze(run)
    assert report.divergence.seq == 11 and report.culprit_ranks == [1]


@pytest.mark.parametrize("name", ["skipped-optimizer-step", "uneven-dtensor-allgather", "straggler", "not-a-desync",
                                  "collective-order-inversion", "healthy", "microbatch-count-mismatch"])
def test_streaming_path_agrees_with_full_load(tmp_path, name):
    write_traces(tmp_path, *builders_of(name))
    full = report_to_dict(analyze(load_run(tmp_path)))
    streamed = report_to_dict(analyze(load_run(tmp_path, stream_above=0, workers=1)))
    for key in ("verdict", "pattern", "culprit_ranks", "divergence", "fixes", "cycle"):
        assert streamed[key] == full[key], key
    assert any("streamed" in i for i in streamed["incomplete"])


def test_streaming_finds_an_early_divergence_far_from_the_tail(tmp_path):
    """A divergence thousands of collectives before the end, outside every file's loaded tail."""
    from moedoctor.analysis.loading import scan

    a, b = ranks(2)
    for i in range(3000):
        for r in (a, b):
            size = 9 if (i == 700 and r is b) else 8
            r.coll("all_reduce", (size,), step=i // 10, line=10 + i % 10)
    write_traces(tmp_path, a, b)
    assert (tmp_path / "rank-00000.jsonl").stat().st_size > 2 * scan.TAIL
    streamed = analyze(load_run(tmp_path, stream_above=0, workers=1))
    assert streamed.divergence.seq == 701 and streamed.culprit_ranks == [1]
    assert streamed.pattern == "shape-mismatch"


def test_streaming_places_a_late_stop_exactly(tmp_path):
    """Thousands of collectives, then one rank stops three before the others: the per-collective
    tail hashes place the divergence exactly, and only a small window is loaded."""
    a, b, c = ranks(3)
    for i in range(3000):
        for r in (a, b, c):
            if r is c and i >= 2997:
                continue
            r.coll("all_reduce", (8,), step=i // 10, line=10 + i % 10, done=i < 2999)
    write_traces(tmp_path, a, b, c)
    run = load_run(tmp_path, stream_above=0, workers=2)
    assert max(len(t.events) for t in run.traces) < 600
    report = analyze(run)
    assert report.divergence.seq == 2998 and report.divergence.missing == (2,) and report.culprit_ranks == [2]


# ---- property: mangled files never raise ---------------------------------------------------------

_BASE = {name: [encode_trace(b) for b in builders_of(name)]
         for name in ("skipped-optimizer-step", "inflight-metric-allreduce", "straggler")}

mangle = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(max_size=40)),
    st.tuples(st.just("json"), st.floats(0, 1), st.sampled_from([
        b'{"k":"c"}', b'[1,2]', b'"x"', b'{"k":"d","t":1,"i":[[1]]}', b'{"k":"a","i":{},"red":3}',
        b'{"k":"g","id":[],"name":1,"ranks":"ab"}', b'{"k":"e","t":"x","kind":1,"step":null}',
        b'{"k":"v","t":1,"reason":"x","groups":[[1,2]]}', b'{"k":"c","i":99,"g":0,"seq":1e400,"s":0,"t":NaN}',
        b'{"k":"s","id":0,"file":null,"line":"x","fn":1}', b'[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]'])),
    st.tuples(st.just("drop_file"),),
    st.tuples(st.just("header"),
              st.sampled_from([b"{}", b"garbage", b'{"format":"moedoctor-trace","version":2}', b""])),
)


def _apply(files: list[bytes], ops) -> list[bytes | None]:
    files = list(files)
    for which, op in ops:
        kind = op[0]
        i = which % len(files)
        data = files[i]
        if data is None:
            continue
        if kind == "truncate":
            files[i] = data[: int(len(data) * op[1])]
        elif kind == "flip":
            pos = int(len(data) * op[1])
            files[i] = data[:pos] + op[2] + data[pos + len(op[2]):]
        elif kind == "insert":
            pos = data.find(b"\n", int(len(data) * op[1])) + 1
            files[i] = data[:pos] + op[2] + b"\n" + data[pos:]
        elif kind == "json":
            pos = data.find(b"\n", int(len(data) * op[1])) + 1
            files[i] = data[:pos] + op[2] + b"\n" + data[pos:]
        elif kind == "drop_file":
            files[i] = None
        elif kind == "header":
            files[i] = op[1] + b"\n" + data.split(b"\n", 1)[-1]
    return files


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(_BASE)), ops=st.lists(st.tuples(st.integers(0, 7), mangle), min_size=1, max_size=4),
       stream=st.booleans())
def test_mangled_traces_never_raise(tmp_path_factory, name, ops, stream):
    folder = tmp_path_factory.mktemp("mangled")
    files = _apply(_BASE[name], ops)
    for rank, data in enumerate(files):
        if data is not None:
            (folder / f"rank-{rank:05d}.jsonl").write_bytes(data)
    try:
        run = load_run(folder, stream_above=0 if stream else 1 << 40, workers=1)
    except MoedoctorError as e:
        assert e.exit_code == 2 and not any(files[r] is not None and files[r][:1] == b"{" for r in range(len(files)))
        return
    report = analyze(run)
    report_to_dict(report)
    changed = [r for r, (a, b) in enumerate(zip(_BASE[name], files)) if a != b]
    detectable = any(files[r] is None or not files[r].endswith(b"\n") or b"garbage" in files[r] for r in changed)
    if detectable:
        assert report.incomplete, ops


_FR = Path(__file__).resolve().parent.parent / "data" / "flight_recorder"


@pytest.mark.skipif(not _FR.is_dir(), reason="no Flight Recorder dumps in tests/data")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["json", "pickle"]),
       ops=st.lists(st.tuples(st.integers(0, 1), mangle), min_size=1, max_size=3))
def test_mangled_flight_recorder_dumps_never_raise(tmp_path_factory, kind, ops):
    folder = tmp_path_factory.mktemp("fr")
    files = _apply([(_FR / kind / f"fr_rank_{r}").read_bytes() for r in (0, 1)], ops)
    for rank, data in enumerate(files):
        if data is not None:
            (folder / f"fr_rank_{rank}").write_bytes(data)
    try:
        run = load_run(folder)
    except MoedoctorError as e:
        assert e.exit_code == 2
        return
    report_to_dict(analyze(run))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(_BASE)), ops=st.lists(st.tuples(st.integers(0, 7), mangle), min_size=1, max_size=4))
def test_mangled_traces_exit_0_1_2_and_healthy_only_with_every_rank(tmp_path_factory, name, ops):
    """Issue 12: every mangled input ends in 0, 1 or 2 (never 3, never a traceback), and 0 (healthy)
    only when every rank's trace is there with a readable header."""
    from moedoctor.cli.main import main

    folder = tmp_path_factory.mktemp("exit")
    files = _apply(_BASE[name], ops)
    for rank, data in enumerate(files):
        if data is not None:
            (folder / f"rank-{rank:05d}.jsonl").write_bytes(data)
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(folder), "--json"])
    assert e.value.code in (0, 1, 2), ops
    if e.value.code == 0:
        assert all(data is not None for data in files), ops
        assert not any(op[0] == "header" for _, op in ops), ops
