"""``moedoctor triage --pid PID``: explain a job that hangs now, from outside, without stopping it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.text import Text

from moedoctor.render.width import console as screen_console
from moedoctor.cli._command import Command
from moedoctor.errors import EXIT_FINDING, EXIT_OK, EXIT_USAGE
from moedoctor.layout import FLIGHT_RECORDER, GPU, STACKS, TRACES
from moedoctor.render.json_report import report_to_dict
from moedoctor.render.terminal import render_report
from moedoctor.runner.rundir import default_run_dir
from moedoctor.triage import TriageResult, merge_triages, triage as run_triage

app = typer.Typer()

DEFAULT_BASE = Path("moedoctor-triage")

EPILOG = (
    "Exit status: 0 no collective problem seen; 1 a desync or a stuck job was found; 2 PID is no torch job, "
    "or nothing could be read. It never kills, stops or signals the job; py-spy pauses each rank for the "
    "milliseconds a stack read takes. Needs ptrace permission (root, or SYS_PTRACE in a container). "
    "Example: moedoctor triage --pid $(pgrep -f torchrun | head -1); a multi-node job: triage --pid on each "
    "node, then moedoctor triage --merge node0-out --merge node1-out"
)


@app.command(cls=Command, epilog=EPILOG)
def triage(
    pid: Annotated[
        Optional[int],
        typer.Option(
            "--pid",
            metavar="PID",
            help="torchrun (the elastic agent), moedoctor run, any rank of the job (a Ray actor too), or the "
            "job's root (mp.spawn's or Lightning's parent, a Ray driver that started its cluster).",
            show_default=False,
        ),
    ] = None,
    merge: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--merge",
            metavar="DIR",
            help="Instead of --pid: one report from the triage folders of a multi-node job's nodes (run "
            "moedoctor triage --pid on each node, gather the --out folders, name each with --merge).",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out",
            metavar="DIR",
            help="Where to write what was collected "
            f"({STACKS}/, {GPU}/, {FLIGHT_RECORDER}/, {TRACES}/). Default: moedoctor-triage/<timestamp>.",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json", metavar="", help='Print the report as JSON (docs/report-format.md) with a "triage" section.'
        ),
    ] = False,
    native: Annotated[
        bool, typer.Option("--native", metavar="", help="Include native (C/C++) frames in the stacks.")
    ] = False,
    no_flight_recorder: Annotated[
        bool,
        typer.Option(
            "--no-flight-recorder",
            metavar="",
            help="Do not ask the job for a Flight Recorder dump through its debug pipe.",
        ),
    ] = False,
) -> None:
    """Find the job's ranks on this node, read their stacks (py-spy, in parallel), the GPUs (NVML), a Flight
    Recorder dump where the job allows one and its moedoctor traces if it runs under moedoctor, and say which
    ranks wait in which collective, which rank is elsewhere, and whether it looks like a code desync, a
    straggler or the hardware."""
    if merge:
        if pid is not None:
            _usage("give either --pid (triage this node) or --merge DIR ... (merge the nodes' triages)")
        report, evidence, notes = merge_triages(merge)
        if json_out:
            doc = report_to_dict(report)
            doc["triage"] = {"merged": [str(d) for d in merge], "evidence": evidence, "notes": notes}
            typer.echo(json.dumps(doc, indent=1, allow_nan=False, default=str))
        else:
            console = screen_console()
            console.print(
                Text(f"Triage of {len(merge)} nodes' folders merged; report from the {evidence}", style="dim"),
                soft_wrap=True,
            )
            for note in notes:
                console.print(Text(f"  {note}", style="dim"), soft_wrap=True)
            render_report(report, console)
        raise typer.Exit(EXIT_FINDING if report.problem_found else EXIT_OK)
    if pid is None:
        _usage("give --pid PID (a rank, torchrun, or moedoctor run of the job), or --merge DIR ...")
    result = run_triage(
        pid, out or default_run_dir(DEFAULT_BASE), native=native, flight_recorder=not no_flight_recorder
    )
    if json_out:
        doc = report_to_dict(result.report)
        doc["triage"] = result.to_dict()
        typer.echo(json.dumps(doc, indent=1, allow_nan=False, default=str))
    else:
        console = screen_console()
        _preface(result, console)
        render_report(result.report, console)
    raise typer.Exit(EXIT_FINDING if result.report.problem_found else EXIT_OK)


def _usage(message: str) -> NoReturn:
    screen_console(stderr=True).print(f"[bold red]moedoctor:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)


def _preface(result: TriageResult, console: Console) -> None:
    who = f"launcher pid {result.launcher}" if result.launcher else f"pid {result.pid}"
    ranks = ", ".join(f"{r.rank} (pid {r.pid}{'' if r.state in 'RS' else ', state ' + r.state})" for r in result.ranks)
    read = sum(1 for d in result.stacks.values() if not d.error)
    console.print(
        Text(
            f"Triage of {who}: ranks {ranks}; {read} of {len(result.stacks)} stacks read; "
            f"report from the {result.evidence}; saved in {result.out_dir}",
            style="dim",
        ),
        soft_wrap=True,
    )
    for note in result.notes:
        console.print(Text(f"  {note}", style="dim"), soft_wrap=True)
