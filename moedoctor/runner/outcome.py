"""What a run came to, read from its run directory once it is over (or its hang is declared): the
analysis of the run (``moedoctor.analysis``, with the fix's reach), written to ``RUN_DIR/report.json``
(the schema of ``moedoctor analyze --json``), the hang record, the coverage, the ranks whose exit is
unknown. The library half of ``moedoctor run``'s last words; ``cli/hang_report.py`` renders them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.analysis import Report, analyze, load_run
from moedoctor.analysis.loading.load import verdict_problem
from moedoctor.analysis.report_json import write_json
from moedoctor.errors import MoedoctorError, cannot_write
from moedoctor.fixes.reach import with_fix_reach
from moedoctor.manifest_format import Manifest
from moedoctor.run_records import HangRecord
from moedoctor.runner.exchange import store_of
from moedoctor.runner.launch import RunResult
from moedoctor.runner.ranks import unknown_exits_line
from moedoctor.runner.rundir import RunDir
from moedoctor.trace.format import STOPPED, read_statuses
from moedoctor.trace.reader import trace_paths


@dataclass
class RunAnalysis:
    """The analysis of a run directory: ``report`` (None when it could not run: ``no_analysis`` says
    why, or ``failure`` how the analysis itself failed), ``written`` the ``report.json`` written (None
    when it could not be: ``write_error`` says why, in one line)."""

    report: Report | None = None
    written: Path | None = None
    write_error: str | None = None
    no_analysis: str | None = None
    failure: str | None = None


def analyze_run_dir(layout: RunDir) -> RunAnalysis:
    """Analyze the run directory and write ``report.json``. Never raises: the run's own result must
    still be reported."""
    try:
        run = load_run(layout.path)
        report = with_fix_reach(analyze(run), run)
        problem = verdict_problem(run, report.verdict)
        if problem is not None:  # never "Healthy: 0 collectives" for a job that never started
            raise MoedoctorError(problem)
        result = RunAnalysis(report)
        try:
            result.written = write_json(report, layout.report)
        except OSError as e:  # disk full: the report is still shown
            result.write_error = cannot_write(layout.report, e, "the report is shown only")
        return result
    except MoedoctorError as e:
        return RunAnalysis(no_analysis=e.message)
    except Exception as e:  # noqa: BLE001 - the run's own result must still be reported
        return RunAnalysis(failure=f"{type(e).__name__}: {e}")


@dataclass
class OtherNodes:
    """A node of a multi-node job with a run directory of its own: it holds ``traced`` of the job's
    ``world`` ranks."""

    traced: int
    world: int


@dataclass
class HangOutcome:
    """What ``moedoctor run`` says once a hang is declared (``hang`` None: the manifest has none)."""

    layout: RunDir
    hang: HangRecord | None
    analysis: RunAnalysis = field(default_factory=RunAnalysis)
    coverage: dict = field(default_factory=dict)
    other_nodes: OtherNodes | None = None


def hang_outcome(run_dir: Path) -> HangOutcome:
    """The hang recorded in ``run_dir``'s manifest, the analysis of the run (``report.json`` written),
    its coverage, and whether other nodes hold the rest of the job's ranks."""
    layout = RunDir(Path(run_dir))
    manifest = Manifest.read(layout.manifest)
    hang = manifest.hang
    if hang is None:
        return HangOutcome(layout, None)
    return HangOutcome(layout, hang, analyze_run_dir(layout), manifest.coverage or {}, _other_nodes(layout, manifest))


def _other_nodes(layout: RunDir, manifest: Manifest) -> OtherNodes | None:
    world, command = manifest.world_size, manifest.command
    traced = len(trace_paths(layout.traces)) if layout.traces.is_dir() else 0
    if world is None or traced >= world or command is None or store_of(command) is None:
        return None
    return OtherNodes(traced, world)


@dataclass
class RunEnd:
    """What ``moedoctor run`` says when the job ended by itself, or moedoctor was interrupted."""

    result: RunResult
    unknown_exits: str | None = None  # the ranks whose exit status cannot be known, in one line
    stopped: list[int] = field(default_factory=list)  # ranks whose recording stopped on a failed write
    coverage: dict | None = None  # the coverage check, when there are traces to cover
    analysis: RunAnalysis | None = None  # when the job ended by itself and its traces are whole


def run_end(result: RunResult) -> RunEnd:
    layout = result.run_dir
    end = RunEnd(result)
    if result.job_exit is not None and result.exit_code != 0:
        end.unknown_exits = unknown_exits_line(layout.manifest)
    end.stopped = sorted(r for r, status in read_statuses(layout.traces).items() if status["state"] == STOPPED)
    if not end.stopped and result.coverage is not None and trace_paths(layout.traces):  # nothing to cover otherwise
        end.coverage = {"complete": result.coverage.complete, "gaps": result.coverage.gaps}
    if result.job_exit is not None and not end.stopped:  # ended by itself: explain it (a crash, or confirm healthy)
        end.analysis = analyze_run_dir(layout)
    return end
