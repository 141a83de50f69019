"""``moedoctor analyze`` on hostile and broken input (issue 12): distinct exit codes (0 healthy,
1 finding, 2 bad input, 3 internal error), healthy only with evidence from every rank, and bounded
work: every input here ends in 0/1/2 within 10 s, in a subprocess so that a hang is a failure."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moedoctor.cli.main import main
from moedoctor.errors import EXIT_BAD_INPUT, EXIT_FINDING, EXIT_INTERNAL, EXIT_OK

REPO = Path(__file__).resolve().parent.parent.parent
GOLDEN = REPO / "tests" / "golden"
LIMIT_S = 10.0


def analyze(path: Path, *extra: str) -> tuple[int, str, float]:
    """``moedoctor analyze`` in a subprocess with a hard 10 s limit (and a 512 MiB address space)."""
    start = time.monotonic()
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            "from moedoctor.cli.main import main; main(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, "analyze", str(path), *extra], capture_output=True,
                          text=True, timeout=LIMIT_S + 20, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def healthy_traces(tmp_path: Path) -> Path:
    folder = tmp_path / "traces"
    shutil.copytree(GOLDEN / "healthy" / "traces", folder)
    return folder


def header(rank: int = 0, world_size: int = 2) -> str:
    return json.dumps({"format": "moedoctor-trace", "version": 1, "rank": rank, "local_rank": rank,
                       "world_size": world_size, "host": "h", "pid": 1, "torch": "2.13", "moedoctor": "0.1.0",
                       "start_time": 1.0})


def assert_bounded(code: int, out: str, seconds: float, allowed=(EXIT_OK, EXIT_FINDING, EXIT_BAD_INPUT)) -> None:
    assert code in allowed, out[-3000:]
    assert seconds < LIMIT_S + 3, f"{seconds:.1f}s: {out[-2000:]}"  # + interpreter start-up
    assert "Traceback" not in out, out[-3000:]


# ---- exit codes ----------------------------------------------------------------------------------

def test_exit_codes_live_in_one_place():
    import moedoctor.errors as errors

    assert (errors.EXIT_OK, errors.EXIT_FINDING, errors.EXIT_BAD_INPUT, errors.EXIT_INTERNAL) == (0, 1, 2, 3)
    assert errors.EXIT_USAGE == errors.EXIT_BAD_INPUT


def test_healthy_exits_0_and_a_finding_exits_1(tmp_path, capsys):
    for name, want in (("healthy", EXIT_OK), ("skipped_optimizer_step", EXIT_FINDING)):
        with pytest.raises(SystemExit) as e:
            main(["analyze", str(GOLDEN / name)])
        assert e.value.code == want, name


def test_internal_error_exits_3_in_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    folder = healthy_traces(tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("boom " + "x" * 10_000)

    monkeypatch.setattr("moedoctor.analysis.loading.trace_files.TraceFolder.finish", broken)
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(folder)])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_INTERNAL
    assert "internal error while reading" in err and "rank-00000.jsonl" in err and "RuntimeError: boom" in err
    assert "Traceback" not in err and len(err) < 1000


def test_internal_error_in_the_analysis_exits_3(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moedoctor.cli.analyze.analyze_run", lambda run: 1 / 0)
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(GOLDEN / "healthy")])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_INTERNAL and "ZeroDivisionError" in err and "Traceback" not in err


# ---- healthy needs evidence ----------------------------------------------------------------------

def test_random_bytes_rank_file_is_bad_input(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "rank-00000.jsonl").write_bytes(os.urandom(4096))
    code, out, seconds = analyze(folder)
    assert code == EXIT_BAD_INPUT, out
    assert "no readable moedoctor trace" in out
    assert_bounded(code, out, seconds)


def test_foreign_jsonl_is_bad_input(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "rank-00000.jsonl").write_text('{"event": "login", "user": "a"}\n{"event": "logout"}\n')
    code, out, _ = analyze(folder)
    assert code == EXIT_BAD_INPUT and "not a moedoctor trace" in out, out


def test_one_rank_unreadable_is_bad_input_not_healthy(tmp_path):
    folder = healthy_traces(tmp_path)
    (folder / "rank-00001.jsonl").write_bytes(os.urandom(2048))
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(folder)])
    assert e.value.code == EXIT_BAD_INPUT


def test_one_rank_missing_is_bad_input_not_healthy(tmp_path, capsys):
    folder = healthy_traces(tmp_path)
    (folder / "rank-00001.jsonl").unlink()
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(folder)])
    assert e.value.code == EXIT_BAD_INPUT
    assert "no readable trace of rank 1 (world size 2)" in capsys.readouterr().err


def test_flight_recorder_every_dump_but_one_unreadable_is_bad_input(tmp_path):
    entry = {"process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce", "collective_seq_id": 1,
             "record_id": 0, "input_sizes": [[4]], "output_sizes": [[4]], "input_dtypes": ["Float"],
             "state": "completed", "time_created_ns": 1, "time_discovered_completed_ns": 2}
    dump = {"version": "2.10", "entries": [entry], "pg_config": {"0": {"ranks": "[0, 1, 2, 3]"}}, "pg_status": {}}
    (tmp_path / "fr_0").write_bytes(pickle.dumps(dump, protocol=2))
    for rank in (1, 2, 3):
        (tmp_path / f"fr_{rank}").write_bytes(b"\x80\x02" + os.urandom(300))
    code, out, seconds = analyze(tmp_path)
    assert code == EXIT_BAD_INPUT, out
    assert "no readable trace of ranks 1-3" in out
    assert_bounded(code, out, seconds)


def test_run_dir_of_a_job_that_never_started_is_bad_input(tmp_path, capsys):
    (tmp_path / "traces").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({
        "status": "finished", "command": ["torchrun", "missing.py"], "world_size": None, "ranks": {},
        "hang": None, "nodes": {"h:1": {"node": "h:1", "status": "finished", "launcher_exit": 1}}}))
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(tmp_path)])
    assert e.value.code == EXIT_BAD_INPUT
    assert "the job never started" in capsys.readouterr().err


# ---- bounded analysis ----------------------------------------------------------------------------

def _dag(depth: int) -> list:
    """A list whose repr doubles with each level (a pickle's memo makes it a few bytes per level),
    with a self-reference at the bottom."""
    x: list = []
    x.append(x)
    for _ in range(depth):
        x = [x, x]
    return x


@pytest.mark.parametrize("depth", [20, 200])
def test_self_referencing_pickle_ends_quickly(tmp_path, depth):
    """The 3.4 KB pickle of the issue: before the fix, the error message formatted the value's repr."""
    from moedoctor.trace import safe_pickle

    entry = {"process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce",
             "collective_seq_id": _dag(depth), "record_id": 0, "input_sizes": [[1]], "output_sizes": [[1]],
             "input_dtypes": ["Float"], "state": "scheduled"}
    dump = {"version": "2.10", "entries": [entry], "pg_config": {"0": {"ranks": "[0]"}}, "pg_status": {}}
    data = pickle.dumps(dump, protocol=2)
    assert len(data) < 4096
    safe_pickle.loads(data)  # the restricted unpickler builds it: plain lists only
    (tmp_path / "fr_0.pkl").write_bytes(data)
    assert_bounded(*analyze(tmp_path))


def test_header_with_a_huge_world_size(tmp_path):
    folder = healthy_traces(tmp_path)
    path = folder / "rank-00000.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[0] = header(0, 10 ** 12) + "\n"
    path.write_text("".join(lines))
    code, out, seconds = analyze(folder)
    assert code == EXIT_BAD_INPUT and "world size 1000000000000 outside" in out, out
    assert_bounded(code, out, seconds)


def test_manifest_with_a_huge_world_size(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "healthy", run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["world_size"] = 10 ** 12
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_bounded(*analyze(run))


@pytest.mark.parametrize("shape", ["many_dims", "huge_dim", "huge_record"])
def test_record_with_a_huge_shape(tmp_path, shape):
    folder = healthy_traces(tmp_path)
    path = folder / "rank-00001.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith('{"k":"c"'))
    record = json.loads(lines[index])
    if shape == "many_dims":
        record["in"] = [[1] * 10 ** 6]
    elif shape == "huge_dim":
        record["in"] = [[10 ** 18]]
    else:
        record["in"] = [[7] * 10] * 2_000_000  # ~60 MB in one line
    lines[index] = json.dumps(record) + "\n"
    path.write_text("".join(lines))
    code, out, seconds = analyze(folder, "--json")
    assert_bounded(code, out, seconds)
    assert len(out) < 2 << 20  # the report does not copy the record


def test_json_dump_over_the_size_cap_is_refused(tmp_path, monkeypatch):
    from moedoctor.trace import flight_recorder, safe_pickle

    monkeypatch.setattr(safe_pickle, "MAX_BYTES", 1000)
    dump = {"version": "2.10", "entries": [], "pg_config": {"0": {"ranks": "[0]"}}, "pg_status": {},
            "pad": "x" * 2000}
    (tmp_path / "fr_0.json").write_text(json.dumps(dump))
    run = flight_recorder.read_flight_recorder(tmp_path)
    assert not run.traces and "larger than a Flight Recorder dump can be" in " ".join(run.incomplete)


def peak_analyze(path: Path) -> tuple[int, str, float, float]:
    """``moedoctor analyze`` as the only child of a fresh parent, which reports its peak resident set
    (``RUSAGE_CHILDREN``'s ``ru_maxrss``): ``(exit status, output, peak MiB, seconds)``."""
    code = ("import resource, subprocess, sys; "
            "p = subprocess.run([sys.executable, '-m', 'moedoctor', 'analyze', sys.argv[1]], capture_output=True, "
            "text=True); print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.stdout.write(p.stdout + p.stderr)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    first, _, out = proc.stdout.partition("\n")
    status, peak_kib = map(int, first.split())
    return status, out + proc.stderr, peak_kib / 1024, time.monotonic() - start


def test_an_oversized_json_dump_is_refused_within_512_mib(tmp_path):
    """Issue 33: a 200 MB JSON dump whose one shape has 100M dimensions was refused only after
    ``json.loads`` had built it (1,181 MiB peak, 21 s, measured before the fix); a 50 MB one of 25M
    dimensions passes the size-first check and is refused by the streamed count of its values."""
    from fuzz_inputs import oversized_json_dump

    head = oversized_json_dump(1)[: -len(b"1]]}]}")]
    for name, items in (("size-first", 100_000_000), ("streamed", 25_000_000)):
        folder = tmp_path / name
        folder.mkdir()
        with open(folder / "fr_rank_0.json", "wb") as f:
            f.write(head)
            for _ in range(items // 1_000_000):
                f.write(b"1," * 1_000_000)
            f.write(b"1]]}]}")
        code, out, peak_mib, seconds = peak_analyze(folder)
        assert code == EXIT_BAD_INPUT, out[-2000:]
        assert "over 320 MiB to parse, refused unparsed" in out and "Traceback" not in out, out[-2000:]
        assert peak_mib < 512, f"{name}: {peak_mib:.0f} MiB peak"
        assert seconds < 60, f"{name}: {seconds:.1f} s"
        (folder / "fr_rank_0.json").unlink()


def test_deeply_nested_json_record_costs_that_record_only(tmp_path):
    folder = healthy_traces(tmp_path)
    path = folder / "rank-00001.jsonl"
    with open(path, "a") as f:
        f.write('{"k":"e","t":1,"kind":"x","step":0,"data":' + "[" * 100_000 + "]" * 100_000 + "}\n")
    assert_bounded(*analyze(folder))


def test_a_stale_running_manifest_is_noted(tmp_path):
    from moedoctor.analysis import load_run

    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "healthy", run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["status"] = "running"
    for node in manifest["nodes"].values():
        node["status"], node["end"] = "running", None
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "supervisor-node0.lock").write_text("999999 gone\n")  # nobody holds it: killed supervisor
    from moedoctor.analysis import analyze as analyze_run
    from moedoctor.analysis.model import Verdict

    loaded = load_run(run)
    assert loaded.manifest.lost_supervisors and loaded.manifest.interrupted
    report = analyze_run(loaded)
    assert report.verdict == Verdict.INTERRUPTED, report.summary
    assert any("supervisor (moedoctor pid" in line and "died" in line for line in report.incomplete)
    # The report is shown, then the one-line reason: no verdict on the job (exit 2, not 0 or 1).
    code, out, seconds = analyze(run)
    assert_bounded(code, out, seconds, allowed=(EXIT_BAD_INPUT,))
    assert "moedoctor: INTERRUPTED" in out and "no verdict on the job" in out, out[-2000:]


def test_the_report_is_bounded(tmp_path):
    from moedoctor.analysis import analyze as analyze_run
    from moedoctor.analysis import load_run
    from moedoctor.render import json_report

    folder = healthy_traces(tmp_path)
    path = folder / "rank-00001.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith('{"k":"c"'))
    record = json.loads(lines[index])
    record["in"] = [[3] * 64] * 4096  # the most a record may hold: a mismatch the report shows
    lines[index] = json.dumps(record) + "\n"
    path.write_text("".join(lines))
    report = analyze_run(load_run(folder))
    doc = json.loads(json_report.dumps(report))
    ops = [op for op in (doc["divergence"] or {"per_rank": {}})["per_rank"].values() if op]
    assert ops and all(len(op["shapes"]) <= json_report.MAX_SHAPES for op in ops)
    assert any(op.get("shapes_total") == [4096, len(op["out_shapes"])] for op in ops)
    small = json.loads(json_report.dumps(report, limit=1000))
    assert small["truncated"] is True and len(small["incomplete"]) <= json_report.CUT_TO


def test_run_dir_of_a_job_that_never_started_is_bad_input_even_when_its_ranks_were_seen_dying(tmp_path, capsys):
    """Whether the runner saw the rank processes before they died is timing (a loaded machine starts
    them slower): with their exit codes in the manifest the verdict would be "crashed, no collective
    divergence recorded"; with no trace and no rank where the recorder loaded it is the same job that
    never started, and says so."""
    (tmp_path / "traces").mkdir()
    seen = {str(r): {"rank": r, "host": "h", "pid": 10 + r, "local_rank": r, "exit_code": 1, "source": "launcher"}
            for r in (0, 1)}
    (tmp_path / "manifest.json").write_text(json.dumps({
        "status": "finished", "command": ["torchrun", "fails.py"], "world_size": 2, "ranks": seen,
        "hang": None, "nodes": {"h:1": {"node": "h:1", "status": "finished", "launcher_exit": 1}}}))
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(tmp_path)])
    assert e.value.code == EXIT_BAD_INPUT
    assert "the job never started" in capsys.readouterr().err
