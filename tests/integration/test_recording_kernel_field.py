"""Which kernel recorded each rank (the header's and each coverage record's ``kernel``) and the
Python version in ``manifest.json``, on real 2-rank Gloo jobs run by ``moedoctor run``: fields added
through the schema and the owners only (issue 34)."""

from __future__ import annotations

import platform
import sys

import pytest

from moedoctor.layout import RunDir
from moedoctor.manifest_format import Manifest
from moedoctor.trace.reader import read_traces
from torchrun_util import REPO, run_command, torchrun_command

JOB = REPO / "tests" / "jobs" / "tiny_healthy.py"


def run(tmp_path, recorder: str):
    run_dir = tmp_path / f"run-{recorder}"
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--recorder", recorder,
           "--", *torchrun_command(JOB, 2)]
    result = run_command(cmd, timeout=240)
    assert result.returncode == 0, result.tail()
    return RunDir(run_dir), result


def kernels(run_dir: RunDir) -> tuple[list, list]:
    traces = read_traces(run_dir.traces)
    return [t.header.kernel for t in traces], [c.kernel for t in traces for c in t.coverage]


def test_the_python_kernel_is_named_in_every_header_and_coverage_and_python_in_the_manifest(tmp_path):
    run_dir, result = run(tmp_path, "python")
    headers, coverage = kernels(run_dir)
    assert headers == ["python", "python"], result.tail()
    assert coverage and set(coverage) == {"python"}, result.tail()
    assert Manifest.read(run_dir.manifest).python_version == platform.python_version()


def test_the_native_kernel_is_named_where_it_recorded(tmp_path):
    from moedoctor.recorder import native

    if not native.available():
        pytest.skip(f"native recorder extension cannot be built here: {native.reason[-400:]}")
    run_dir, result = run(tmp_path, "native")
    headers, coverage = kernels(run_dir)
    assert headers == ["native", "native"], result.tail()
    assert coverage and set(coverage) == {"native"}, result.tail()
