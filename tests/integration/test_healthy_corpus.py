"""The healthy corpus: real distributed jobs that moedoctor must never raise an alarm on (Gloo).

Every ``fixtures/healthy_*/`` job (EP all-to-all dispatch with uneven splits, collectives from a
second thread, rank-dependent roots, 2-D meshes, DTensor and compiled functional collectives, a
long step, ``no_sync`` accumulation, pipeline p2p, subgroups, ...) runs under
``moedoctor run --hang-timeout 20`` with the rank count of its ``expected.yaml`` (``nproc``), its
extra arguments (``args``) and environment (``env``). Each must exit 0 with no desync or hang
alarm, no hang in the manifest, every rank traced, collectives recorded with complete coverage,
and ``moedoctor analyze --json`` must exit 0 with verdict ``healthy``. A lag line (a rank a step
behind while the others wait) is a report, not an alarm, and is allowed. Jobs whose
``expected.yaml`` says ``heavy: true`` (over ~25 s here) are marked heavy.

Busy is not stuck: the ``healthy_busy_*`` jobs (every rank saving; rank 0 saving while the others
wait at a barrier; every rank in DTensor arithmetic; a long first ``torch.compile``) run under the
short ``hang_timeout`` of their ``expected.yaml`` with a busy phase of at least twice that, so the
collectives are silent past the timeout for real: each must still exit 0, healthy, and the report
must carry the busy phase (``busy: true``), longer than the timeout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from torchrun_util import (ALARMS, FIXTURES, REPO, JobResult, job_env, run_command, torch_exit_abort,
                           torchrun_command)

from moedoctor.analysis import analyze, load_run
from moedoctor.render.json_report import report_to_dict

HANG_TIMEOUT = 20
JOB_TIMEOUT = 120.0

CORPUS = sorted(p.parent for p in FIXTURES.glob("healthy_*/expected.yaml"))


def _params():
    for job in CORPUS:
        expected = yaml.safe_load((job / "expected.yaml").read_text())
        marks = [pytest.mark.heavy] if expected.get("heavy") else []
        yield pytest.param(job.name, marks=marks, id=job.name)


def _four_rank_params():
    for job in CORPUS:
        if yaml.safe_load((job / "expected.yaml").read_text()).get("max_nproc", 0) >= 4:
            yield pytest.param(job.name, marks=[pytest.mark.heavy], id=job.name)


def run_healthy_job(name: str, run_dir: Path, nproc: int | None = None) -> tuple[dict, JobResult]:
    expected = yaml.safe_load((FIXTURES / name / "expected.yaml").read_text())
    if nproc is not None:
        expected["nproc"] = nproc
    timeout = expected.get("hang_timeout", HANG_TIMEOUT)
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", str(timeout),
           "--", *torchrun_command(FIXTURES / name / "train.py", expected["nproc"], *expected.get("args", []))]
    env = job_env(**{k: str(v) for k, v in (expected.get("env") or {}).items()})
    return expected, run_command(cmd, JOB_TIMEOUT, env=env, cwd=REPO)


def test_corpus_is_there():
    assert len(CORPUS) >= 12, [p.name for p in CORPUS]
    for job in CORPUS:
        expected = yaml.safe_load((job / "expected.yaml").read_text())
        assert expected["verdict"] == "healthy" and expected["pattern"] is None, job.name
        assert expected["nproc"] in (2, 3, 4), job.name


@pytest.mark.parametrize("name", list(_params()))
def test_healthy_job_raises_no_alarm(name, tmp_path):
    check_healthy_run(name, tmp_path / "run")


@pytest.mark.parametrize("name", list(_four_rank_params()))
def test_healthy_job_at_four_ranks(name, tmp_path):
    """The jobs whose ``expected.yaml`` has ``max_nproc: 4`` (2-D meshes (2, 2), 4 pipeline stages,
    experts over 4 ranks, 2 simulated nodes), at 4 ranks: slow on 2 cores, so heavy."""
    check_healthy_run(name, tmp_path / "run", nproc=4)


def check_healthy_run(name: str, run_dir: Path, nproc: int | None = None) -> None:
    expected, result = run_healthy_job(name, run_dir, nproc)
    if torch_exit_abort(result, run_dir):
        print(f"{name}: a rank aborted at exit (PyTorch teardown race); retrying once\n{result.tail(20)}")
        run_dir = run_dir.with_name(run_dir.name + "-retry")
        expected, result = run_healthy_job(name, run_dir, nproc)
    context = f"{name}: exit {result.returncode} after {result.seconds:.1f}s\n--- log tail ---\n{result.tail(60)}"
    alarms = [line for line in result.output.splitlines() if any(a in line for a in ALARMS)]
    assert not alarms, "false alarm:\n" + "\n".join(alarms) + "\n" + context
    assert result.returncode == 0, context

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["hang"] is None, (manifest["hang"], context)

    # What `moedoctor analyze --json` prints, computed in this process (a CLI process per job costs
    # seconds on 2 cores; the CLI itself is tested in tests/cli).
    report = report_to_dict(analyze(load_run(run_dir)))
    analysis_context = (f"analysis: {report['verdict']}: {report['summary']}\n"
                        f"evidence: {report['evidence']}\n{context}")
    assert report["verdict"] == "healthy", analysis_context
    assert report["pattern"] is None and report["divergence"] is None, analysis_context

    # A healthy verdict on an empty recording proves nothing: every rank must have been traced.
    nproc = expected["nproc"]
    source = report["source"]
    assert source["traced_ranks"] == list(range(nproc)), (source, report["incomplete"], context)
    assert source["collectives"] > 0, (source, report["incomplete"], context)
    coverage = manifest.get("coverage") or {}
    assert coverage.get("complete"), (coverage, context)

    if expected.get("busy"):  # silent past the timeout, judged busy, and said so in the report
        timeout = expected["hang_timeout"]
        busy = [b for b in report["busy"] if b["kind"] == "busy" and b["seconds"] >= timeout]
        assert busy, (report["busy"], context)
        assert "moedoctor: busy" in result.output, context
        if expected.get("busy_line"):
            assert any(expected["busy_line"] in b["line"] for b in busy), (report["busy"], context)
