"""Fuzzing ``moedoctor analyze`` (issue 12): every input, however damaged or hostile, ends in exit
0, 1 or 2 (never 3, never a traceback) within 10 s and 512 MiB.

Inputs are drawn by tests/fuzz_inputs.py: moedoctor traces and run directories (JSONL traces,
manifest, stacks, GPU snapshots, status files) and PyTorch Flight Recorder dumps (pickle and JSON).
Each is analyzed by a long-lived worker process (tests/analyze_worker.py) running
``moedoctor analyze`` in-process under an address-space cap of what it holds after a warm-up plus
512 MiB; the worker answers with the exit status, the time taken and the output, and a worker that
has not answered within the time limit is killed and the input fails. Half the inputs are
analyzed with ``--json``.

A quick subset runs in CI (derandomized, 60 inputs of each kind); ``-m heavy`` runs 1,000 of each.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_inputs import GOLDEN, flight_recorder_inputs, trace_inputs, write_input

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "analyze_worker.py"
LIMIT_S = 10.0
BUDGET_MIB = 512
QUICK = 60
HEAVY = 1000


class Worker:
    """The analyze worker; restarted after an input that killed it or ran out of time."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.limit = 0

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(GOLDEN / "healthy"), str(BUDGET_MIB)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        ready = self._reply(120.0)
        assert ready and ready.get("ready"), f"the analyze worker did not start: {ready}"
        self.limit = ready["limit"]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _reply(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def analyze(self, path: Path, json_out: bool) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        args = ["analyze", str(path)] + (["--json"] if json_out else [])
        start = time.monotonic()
        self.proc.stdin.write(json.dumps({"args": args}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(LIMIT_S + 5.0)
        if reply is None:
            code = self.proc.poll()
            self.stop()
            return {"code": None, "seconds": time.monotonic() - start, "out": "",
                    "traceback": f"the worker {'died (status %s)' % code if code is not None else 'did not answer'}"}
        return reply


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    w.start()
    yield w
    w.stop()


def check(worker: Worker, folder: Path, files: dict, json_out: bool) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    write_input(folder, files)
    result = worker.analyze(folder, json_out)
    shown = {k: (len(v) if isinstance(v, bytes) else v) for k, v in files.items()}
    assert result["code"] in (0, 1, 2), f"exit {result['code']}: {result['traceback'] or result['out']}\n{shown}"
    assert result["seconds"] < LIMIT_S, f"{result['seconds']:.1f} s\n{shown}"
    assert "Traceback" not in result["out"], result["out"]


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


@settings(max_examples=QUICK, derandomize=True, **SETTINGS)
@given(files=trace_inputs(), json_out=st.booleans())
def test_damaged_traces_end_in_0_1_2(worker, tmp_path, files, json_out):
    check(worker, tmp_path / "input", files, json_out)


@settings(max_examples=QUICK, derandomize=True, **SETTINGS)
@given(files=flight_recorder_inputs(), json_out=st.booleans())
def test_damaged_flight_recorder_dumps_end_in_0_1_2(worker, tmp_path, files, json_out):
    check(worker, tmp_path / "input", files, json_out)


@pytest.mark.heavy
@settings(max_examples=HEAVY, **SETTINGS)
@given(files=trace_inputs(), json_out=st.booleans())
def test_damaged_traces_end_in_0_1_2_heavy(worker, tmp_path, files, json_out):
    check(worker, tmp_path / "input", files, json_out)


@pytest.mark.heavy
@settings(max_examples=HEAVY, **SETTINGS)
@given(files=flight_recorder_inputs(), json_out=st.booleans())
def test_damaged_flight_recorder_dumps_end_in_0_1_2_heavy(worker, tmp_path, files, json_out):
    check(worker, tmp_path / "input", files, json_out)


def test_the_worker_runs_under_the_memory_cap(worker, tmp_path):
    """The worker's address space is capped at what it held after its warm-up plus 512 MiB, so an
    input that needed more would fail there (exit 3), not pass unnoticed."""
    assert worker.analyze(tmp_path / "missing", False)["code"] == 2
    with open(f"/proc/{worker.proc.pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max address space"))
    assert int(line.split()[3]) == worker.limit
    with open(f"/proc/{worker.proc.pid}/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    assert worker.limit - size <= BUDGET_MIB << 20


@pytest.mark.parametrize("manifest", [b"[" * 100_000 + b"]" * 100_000, b'{"command": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_a_manifest_nested_past_the_parser_is_bad_input_not_a_crash(worker, tmp_path, manifest):
    """Found by the fuzz suite: the manifest reader let the parser's RecursionError escape: exit 3.
    (The launch command, nested past the parser in the second input, is read there too.)"""
    files = {f"traces/{p.name}": p.read_bytes() for p in sorted((GOLDEN / "healthy" / "traces").iterdir())}
    check(worker, tmp_path / "input", {**files, "manifest.json": manifest}, json_out=False)
