"""``moedoctor analyze PATH``: explain a hang from a run directory, traces or Flight Recorder dumps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from moedoctor.render.width import console as screen_console
from moedoctor.cli._command import Command
from moedoctor.cli.params import render_params_check, run_params_check
from moedoctor.analysis import analyze as analyze_run
from moedoctor.analysis import load_runs
from moedoctor.analysis.loading.load import verdict_problem
from moedoctor.analysis.model import Verdict
from moedoctor.analysis.params import has_params
from moedoctor.errors import EXIT_BAD_INPUT, EXIT_FINDING, EXIT_OK, MoedoctorError, reading
from moedoctor.fixes.reach import with_fix_reach
from moedoctor.render.html import write_html
from moedoctor.render.json_report import dumps_with_params
from moedoctor.render.perfetto import write_perfetto
from moedoctor.render.terminal import render_report

app = typer.Typer()

EPILOG = (
    "Exit status: 0 healthy (a readable trace of every rank); 1 a desync, a stuck job or a crashed rank "
    "was found; 2 the input could not be analyzed or cannot back a verdict; 3 an internal error. "
    "Example: moedoctor analyze moedoctor-runs/20250101-120000 --html report.html; a job run with one run "
    "directory per node: moedoctor analyze node0-run node1-run"
)


@app.command(cls=Command, epilog=EPILOG)
def analyze(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="A run directory (moedoctor run), a folder of moedoctor traces (rank-*.jsonl), or a folder of "
            "PyTorch Flight Recorder dumps. Several run directories (or trace folders) of one job, one per node "
            "(each node's moedoctor run with its own --run-dir): merged into one analysis.",
            show_default=False,
            metavar="PATH",
        ),
    ],
    json_out: Annotated[
        bool, typer.Option("--json", metavar="", help="Print the report as JSON (docs/report-format.md).")
    ] = False,
    perfetto: Annotated[
        Optional[Path],
        typer.Option(
            "--perfetto",
            metavar="FILE",
            help="Write a Perfetto / Chrome trace: one track per rank, the divergence "
            "marked (open at ui.perfetto.dev).",
            show_default=False,
        ),
    ] = None,
    html: Annotated[
        Optional[Path],
        typer.Option(
            "--html",
            metavar="FILE",
            help="Write the report as a self-contained HTML page (no network): lanes of collectives per "
            "rank, the wait-for graph, stacks, evidence, fix; it links the --perfetto trace when given.",
            show_default=False,
        ),
    ] = None,
    params: Annotated[
        bool,
        typer.Option(
            "--params",
            metavar="",
            help="Only the parameter consistency check of a run recorded with moedoctor run --check-params "
            "(overwritten-shards): exit 1 when a parameter is inconsistent across ranks.",
        ),
    ] = False,
) -> None:
    """Find where the ranks diverged, name the deadlock pattern, the culprit ranks and the call site,
    and print the fix with the command that verifies it."""
    path = paths[0]
    if params:
        if len(paths) > 1:
            raise MoedoctorError("--params takes one run directory")
        if not has_params(path):
            raise MoedoctorError(f"{path} holds no parameter fingerprints (record with moedoctor run --check-params)")
        with reading(path):
            check = run_params_check(path)
        assert check is not None
        if json_out:
            typer.echo(json.dumps(check.to_json(), indent=1))
        else:
            render_params_check(check, screen_console())
        raise typer.Exit(EXIT_FINDING if check.problem_found else EXIT_OK)
    with reading(path):
        run = load_runs(paths)
        report = with_fix_reach(analyze_run(run), run)
    problem = verdict_problem(run, report.verdict)
    if problem is not None:  # healthy needs evidence: every rank's trace, readable and whole
        raise MoedoctorError(problem, EXIT_BAD_INPUT)
    check = run_params_check(path) if has_params(path) else None  # recorded with --check-params
    if json_out:
        typer.echo(dumps_with_params(report, None if check is None else check.to_json()))
    else:
        render_report(report, screen_console())
        if check is not None:
            render_params_check(check, screen_console())
    err = screen_console(stderr=True)
    if perfetto is not None:
        err.print(f"Perfetto trace: {write_perfetto(run, report, perfetto)}", highlight=False, soft_wrap=True)
    if html is not None:
        page = write_html(report, html, run, perfetto, None if check is None else check.to_json())
        err.print(f"HTML report: {page}", highlight=False, soft_wrap=True)
    if report.verdict == Verdict.INTERRUPTED and not (check and check.problem_found):
        # Nothing wrong up to the stop, but the run did not end: no verdict on the job (exit 2).
        raise MoedoctorError(f"{report.summary.split('. ')[0]}: no verdict on the job", EXIT_BAD_INPUT)
    raise typer.Exit(EXIT_FINDING if report.problem_found or (check and check.problem_found) else EXIT_OK)
