"""Real Flight Recorder dumps of a real hang (Gloo, 2 ranks): moedoctor reads them, pickle and JSON
alike, and finds what torchfrtrace finds only once the dumps' Gloo ``pg_config`` is repaired."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from moedoctor.trace.flight_recorder import is_flight_recorder_dir, read_flight_recorder
from torchrun_util import REPO, assert_ok, job_env, run_command, torchrun_command

JOB = REPO / "tests" / "jobs" / "fr_dump.py"
SAMPLES = REPO / "tests" / "data" / "flight_recorder"


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(JOB.read_text().splitlines(), start=1) if text in line)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fr")
    result = run_command(torchrun_command(JOB, 2, str(out), "--timeout", "8"), timeout=120,
                         env=job_env(TORCH_FR_BUFFER_SIZE="2000"))
    assert_ok(result)
    assert "Timed out" in result.output, result.tail()
    return out


def summary(run) -> list[list[tuple]]:
    return [[(e.group.name, e.seq, e.op, e.in_shapes, e.out_shapes, e.dtypes, e.completed is None) for e in t.events]
            for t in run.traces]


@pytest.mark.parametrize("encoding", ["pickle", "json"])
def test_dumps_of_a_hang_read_as_traces(dumps, encoding):
    folder = dumps / encoding
    assert is_flight_recorder_dir(folder)
    run = read_flight_recorder(folder)
    assert [t.rank for t in run.traces] == [0, 1] and all(t.problems == [] for t in run.traces)
    rank0, rank1 = ([e for e in t.events if e.group.name == "0"] for t in run.traces)
    # rank 1 skipped the metric all_reduce of the last step: rank 0 is alone, still inside seq 11
    assert [e.seq for e in rank0] == list(range(1, 12)) and [e.seq for e in rank1] == list(range(1, 11))
    stuck = rank0[-1]
    assert (stuck.op, stuck.in_shapes, stuck.dtypes, stuck.completed) == ("all_reduce", ((1,),), ("float64",), None)
    # Gloo retires a work lazily: rank 1's very last collective may not show as complete yet.
    assert all(e.completed is not None for e in rank0[:-1] + rank1[:-1])
    if encoding == "pickle":
        assert (stuck.call_site.file, stuck.call_site.line, stuck.call_site.function) == (
            str(JOB), line_of("dist.all_reduce(torch.tensor("), "train_step")
        assert rank1[-1].call_site.line == line_of("dist.all_reduce(grads)")
    else:
        assert stuck.call_site is None
    # the committed samples were made by this job and still say the same
    assert summary(run) == summary(read_flight_recorder(SAMPLES / encoding))


def torchfrtrace(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                           "-p", "fr_rank_"], capture_output=True, text=True, timeout=120, env=job_env())


def test_torchfrtrace_needs_the_gloo_pg_config_repaired(dumps, tmp_path):
    raw = torchfrtrace(dumps / "pickle")
    if raw.returncode != 0:  # torch 2.13: pg_config's key is "" while entries name group "0"
        assert "KeyError" in raw.stderr, raw.stderr[-2000:]
    for rank in (0, 1):
        with open(dumps / "pickle" / f"fr_rank_{rank}", "rb") as f:
            dump = pickle.load(f)  # written by our own job above
        dump["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
                             "1": {"name": "1", "desc": "undefined", "ranks": "[0, 1]"}}
        (tmp_path / f"fr_rank_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    repaired = torchfrtrace(tmp_path)
    out = repaired.stdout + repaired.stderr
    assert "sequence number: 11" in out and "missing ranks: {1}" in out, out[-2000:]
