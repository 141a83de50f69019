"""Run the optimizer, checkpoint, straggler and hardware-like fixtures for real (2 ranks, Gloo).

Each broken run must fail by itself at the short process-group timeout, or (hardware_like) be killed
at the test timeout, never complete; each fixed run must exit 0. No process of a job may survive it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from torchrun_util import FIXTURES, JobResult, assert_ok, live_processes, run_fixture

NPROC = 2
PG_TIMEOUT = ("--pg-timeout", "10")
FIXTURE_NAMES = ["skipped_optimizer_step", "uneven_dtensor_allgather", "straggler", "hardware_like"]
STEP_LINE = re.compile(r"\[rank (\d+)\] step (\d+) loss \d+\.\d+")
# file:LINE (`code`) in expected.yaml notes: a line reference with the code that line must contain.
CODE_REF = re.compile(r"((?:_lib/)?\w+\.py):(\d+) \(`([^`]+)`\)")


def surviving_processes(name: str) -> list[int]:
    """Live (non-zombie) processes running this fixture's train.py."""
    script = f"fixtures/{name}/train.py".encode()
    return live_processes(lambda proc: script in (proc / "cmdline").read_bytes())


def run_and_reap(name: str, *args: str, timeout: float = 60.0) -> JobResult:
    result = run_fixture(name, NPROC, *PG_TIMEOUT, *args, timeout=timeout)
    deadline = time.monotonic() + 5  # a SIGKILLed process needs a moment to go
    while surviving_processes(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not surviving_processes(name), f"processes of {name} survived the job:\n{result.tail()}"
    return result


def assert_hung(result: JobResult, last_logged_step: int) -> None:
    """Failed with a rank timing out in a collective, every rank having logged the steps up to
    ``last_logged_step`` and none a later one."""
    assert result.returncode != 0, f"job was expected to hang:\n{result.tail()}"
    assert "Timed out waiting 10000ms" in result.output, result.tail()
    logged = {(int(rank), int(step)) for rank, step in STEP_LINE.findall(result.output)}
    assert logged == {(r, s) for r in range(NPROC) for s in range(last_logged_step + 1)}, result.tail()
    assert "training done" not in result.output, result.tail()


def ranks_logging(result: JobResult, text: str) -> set[int]:
    return {rank for rank in range(NPROC) if f"[rank {rank}] {text}" in result.output}


def test_skipped_optimizer_step_hangs() -> None:
    assert_hung(run_and_reap("skipped_optimizer_step"), last_logged_step=2)


def test_skipped_optimizer_step_fixed() -> None:
    result = run_and_reap("skipped_optimizer_step", "--apply-fix")
    assert_ok(result)
    assert ranks_logging(result, "step 2 skipped") == {0, 1}, result.tail()
    assert ranks_logging(result, "step 3 loss") == {0, 1}, result.tail()


def test_uneven_dtensor_model_and_optimizer_save_hangs(tmp_path: Path) -> None:
    result = run_and_reap("uneven_dtensor_allgather", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert_hung(result, last_logged_step=2)


def test_uneven_dtensor_model_only_save_passes(tmp_path: Path) -> None:
    result = run_and_reap("uneven_dtensor_allgather", "--save-contents", "model",
                          "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert_ok(result)
    assert ranks_logging(result, "checkpoint saved") == {0, 1}, result.tail()


def test_uneven_dtensor_fixed_round_trips(tmp_path: Path) -> None:
    result = run_and_reap("uneven_dtensor_allgather", "--apply-fix",
                          "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert_ok(result)
    assert ranks_logging(result, "checkpoint round trip OK") == {0, 1}, result.tail()


def test_straggler_hangs_until_pg_timeout() -> None:
    assert_hung(run_and_reap("straggler"), last_logged_step=1)


@pytest.mark.heavy  # in the suite: test_diagnose_fixtures[hardware_like] (the same hang, under moedoctor run)
def test_hardware_like_never_completes() -> None:
    # Left alone, torchrun needs its 30 s SIGTERM grace to end the stopped rank: kill it sooner.
    assert_hung(run_and_reap("hardware_like", timeout=30), last_logged_step=1)


def source_line(name: str, path: str, line: str) -> str:
    source = FIXTURES / path if path.startswith("_lib/") else FIXTURES / name / path
    return source.read_text().splitlines()[int(line) - 1]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_expected_yaml_points_at_real_code(name: str) -> None:
    expected = yaml.safe_load((FIXTURES / name / "expected.yaml").read_text())
    assert expected["nproc"] == NPROC and set(expected["culprit_ranks"]) <= set(expected["group_ranks"])
    call_site = source_line(name, *expected["call_site"].rsplit(":", 1))
    assert f"{expected['collective']}(" in call_site, f"{expected['call_site']} is: {call_site.strip()}"
    for path, line, code in CODE_REF.findall(expected["notes"]):
        assert code in source_line(name, path, line), f"{name}: {path}:{line} no longer holds `{code}`"
