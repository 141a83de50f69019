"""Shared between the integration tests: each fixture's run under ``moedoctor run``, made once per
session (the diagnosis tests check it, the verify tests fix it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torchrun_util import FIXTURES, REPO, JobResult, run_command, torchrun_command

NPROC = 2


def moedoctor_run(run_dir: Path, name: str, timeout: float = 90.0) -> JobResult:
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "8", "--",
           *torchrun_command(FIXTURES / name / "train.py", NPROC, "--pg-timeout", "60")]
    return run_command(cmd, timeout, cwd=REPO)


@pytest.fixture(scope="session")
def diagnosed_run(tmp_path_factory):
    """``diagnosed_run(name) -> (run_dir, result)``: the fixture run under ``moedoctor run``, once."""
    runs: dict[str, tuple[Path, JobResult]] = {}

    def get(name: str) -> tuple[Path, JobResult]:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(f"run-{name}") / "run"
            runs[name] = (run_dir, moedoctor_run(run_dir, name))
        return runs[name]

    return get
