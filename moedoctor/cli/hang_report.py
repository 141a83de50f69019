"""What ``moedoctor run`` prints when it is over. ``report_after_hang(run_dir, console)`` is the one
place the post-hang report is rendered, from the run directory alone: the analysis report, which
the library (``runner/outcome.py``) also wrote to ``RUN_DIR/report.json`` (the schema of
``moedoctor analyze --json``). A job that ends by itself is analyzed too: a crashed rank gets the
full report, a healthy run one line. Rendering only: what to say comes from ``runner.outcome``."""

from __future__ import annotations

import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moedoctor.analysis import Verdict
from moedoctor.wording import phase_label
from moedoctor.render.terminal import render_report, render_slow
from moedoctor.runner import RunResult
from moedoctor.runner.outcome import RunAnalysis, hang_outcome, run_end


def report_after_hang(run_dir: Path, console: Console) -> None:
    """The hang in one line, then the analysis report; ``report.json`` written into the run directory.
    If the analysis cannot run, the per-rank table of the watchdog's hang record instead."""
    outcome = hang_outcome(Path(run_dir))
    layout, hang = outcome.layout, outcome.hang
    if hang is None:
        console.print(f"moedoctor: no hang recorded in {escape(str(layout.manifest))}", soft_wrap=True)
        return
    stopped = "stopping the job" if hang.stopped else "job left running (--keep-alive)"
    if hang.trigger == "no-trace":
        console.print(
            f"\n[bold red]No trace after {hang.idle_seconds:.1f}s[/] (hang timeout {hang.hang_timeout:g}s): "
            f"{escape(hang.finding or '?')}. Diagnosed from the stacks; the job is left running until the "
            "startup timeout, since loading and rendezvous can legitimately take that long.",
            highlight=False,
            soft_wrap=True,
        )
    elif hang.trigger == "desync":
        latency = hang.detection_latency_s
        after = f", {latency:.1f} s after it was issued" if latency is not None else ""
        console.print(
            f"\n[bold red]Desync detected while the job ran[/]: {escape(hang.finding or '?')}{after}; {stopped}.",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"\n[bold red]Hang[/]: no rank made progress for {hang.idle_seconds:.1f}s "
            f"(hang timeout {hang.hang_timeout:g}s) on {escape(hang.host)}; {stopped}.",
            highlight=False,
            soft_wrap=True,
        )
        if hang.proof:
            label = {"max-busy": "Stopped by --max-busy", "peer": "Proven on another node"}.get(hang.trigger, "Proof")
            console.print(f"[bold]{label}[/]: {escape(hang.proof)}", highlight=False, soft_wrap=True)
    for lag in hang.lags[:5]:
        console.print(f"[yellow]Lag[/]: {escape(lag)}", highlight=False, soft_wrap=True)
    first = hang.mechanism if hang.trigger == "desync" else None
    written = render_analysis(outcome.analysis, layout.path, console, first_mechanism=first)
    if written is None:
        _hang_table(hang, console)
    _print_coverage(outcome.coverage, console)
    files = [f"{layout.stacks}/", f"{layout.gpu}/", str(layout.manifest), str(layout.job_log)]
    if written is not None:
        files.insert(0, str(written))
    console.print("Written: " + "  ".join(escape(f) for f in files), highlight=False, soft_wrap=True)
    console.print(
        f"Next: [bold]moedoctor analyze {escape(str(layout.path))}[/] (add --html FILE or --perfetto FILE)",
        highlight=False,
        soft_wrap=True,
    )
    other = outcome.other_nodes
    if other is not None:  # a node of a multi-node job with a run directory of its own holds its own ranks only
        console.print(
            f"This node's run directory holds {other.traced} of the job's {other.world} ranks (a run directory per "
            f"node): for the whole job, gather the nodes' run directories and run [bold]moedoctor analyze "
            f"{escape(str(layout.path))} OTHER_NODE_RUN_DIR ...[/]",
            highlight=False,
            soft_wrap=True,
        )


def render_analysis(
    analysis: RunAnalysis,
    run_dir: Path,
    console: Console,
    quiet_if_healthy: bool = False,
    first_mechanism: str | None = None,
) -> Path | None:
    """Render the analysis of the run (``runner.outcome.analyze_run_dir``); the ``report.json`` it
    wrote, or None when the analysis could not run (the reason is printed). ``first_mechanism``: the
    one the online detector's first report named; said again when the analysis, with the ranks'
    history, reads another."""
    if analysis.write_error is not None:  # disk full: the report is still shown
        console.print(f"[yellow]moedoctor: {escape(analysis.write_error)}[/]", highlight=False, soft_wrap=True)
    if analysis.no_analysis is not None:
        console.print(
            f"[yellow]moedoctor: no analysis:[/] {escape(analysis.no_analysis)}", highlight=False, soft_wrap=True
        )
        return None
    report = analysis.report
    if report is None:  # the analysis itself failed
        console.print(
            f"[yellow]moedoctor: the analysis failed ({escape(analysis.failure or '?')}); "
            f"the run is recorded, try: moedoctor analyze {escape(str(run_dir))}[/]",
            highlight=False,
            soft_wrap=True,
        )
        return None
    if quiet_if_healthy and report.verdict == Verdict.HEALTHY:
        console.print(f"[green]Analysis[/]: {escape(report.summary)}", highlight=False, soft_wrap=True)
        render_slow(report, console)  # a healthy job can still be slow: say where its time went
    else:
        render_report(report, console)
    final = report.mechanism.mechanism.value if report.mechanism is not None else None
    if first_mechanism and final and final != first_mechanism:
        console.print(
            f"[dim]The first report's mechanism, {escape(first_mechanism)}, came from the two collectives the "
            f"detector compared; read with the ranks' history it is {escape(final)}.[/]",
            highlight=False,
            soft_wrap=True,
        )
    return analysis.written


def _hang_table(hang, console: Console) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("rank", "last collective", "group", "state", "phase", "step", "call site"):
        table.add_column(name, overflow="fold")
    for r in hang.ranks:
        if r.last is None:
            table.add_row(str(r.rank), "none: no trace (stuck before init_process_group?)", "", "", "", "", "")
            continue
        last = r.last
        site = last.call_site.rsplit("/", 1)[-1] if last.call_site else "?"
        table.add_row(
            str(r.rank),
            f"{last.op} #{last.seq}",
            escape(last.group),
            "done" if last.completed else "waiting",
            phase_label(last.phase),
            str(last.step),
            escape(site),
        )
    console.print(table)
    for r in hang.ranks:
        if r.stack_error:
            console.print(f"[yellow]rank {r.rank}:[/] {escape(r.stack_error)}", highlight=False, soft_wrap=True)
        elif r.waiting_in:
            where = r.waiting_in if r.user_frame in (None, r.waiting_in) else f"{r.waiting_in} <- {r.user_frame}"
            console.print(f"rank {r.rank} main thread waits in {escape(where)}", highlight=False, soft_wrap=True)


def report_after_run(result: RunResult, console: Console) -> None:
    """The job ended by itself, or moedoctor was interrupted."""
    layout = result.run_dir
    if result.job_exit is None:
        console.print(f"moedoctor: interrupted; the job was stopped (exit {result.exit_code})", soft_wrap=True)
    else:
        console.print(f"moedoctor: the job exited with status {result.exit_code}", soft_wrap=True)
    end = run_end(result)
    if end.unknown_exits is not None:  # a failed job whose failed ranks cannot be named from their exits
        console.print(f"moedoctor: {end.unknown_exits}", soft_wrap=True, highlight=False)
    if result.hang is not None:
        console.print(
            f"A hang was diagnosed at {time.strftime('%H:%M:%S', time.localtime(result.hang.detected_at))}"
            " and the job left running (--keep-alive); see the manifest's hang record.",
            soft_wrap=True,
        )
    stopped = end.stopped
    if stopped:  # the traces end before the job did: no verdict from them (docs/guarantees.md)
        console.print(
            f"[yellow]moedoctor: the recording stopped on rank{'s' if len(stopped) > 1 else ''} "
            f"{','.join(map(str, stopped[:20]))}{' ...' if len(stopped) > 20 else ''} (one of its writes "
            "failed, said above): the traces end before the job did, so the run is not analyzed[/]",
            highlight=False,
            soft_wrap=True,
        )
    elif end.coverage is not None:
        _print_coverage(end.coverage, console)
    if end.analysis is not None:  # ended by itself: explain it (a crash, or confirm healthy)
        written = render_analysis(end.analysis, layout.path, console, quiet_if_healthy=True)
        if written is not None:
            console.print(f"Report: {escape(str(written))}", highlight=False, soft_wrap=True)
    console.print(
        f"Run recorded in {escape(str(layout.path))}; next: [bold]moedoctor analyze {escape(str(layout.path))}[/]",
        highlight=False,
        soft_wrap=True,
    )


def _print_coverage(coverage: dict, console: Console) -> None:
    if not coverage:
        return
    if coverage.get("complete"):
        console.print("Coverage: complete (every group's recorded count matches the backend's counter)")
        return
    gaps = coverage.get("gaps", [])
    console.print(f"[yellow]Coverage: {len(gaps)} gap(s)[/]", highlight=False, soft_wrap=True)
    for gap in gaps[:10]:
        console.print(f"  {escape(_gap_line(gap))}", highlight=False, soft_wrap=True)


def _gap_line(gap: dict) -> str:
    """``rank 1, group 0: 41 recorded, the backend counted 43`` / ``rank 0: no trace``."""
    where = f"rank {gap.get('rank')}" + (f", group {gap['group']}" if "group" in gap else "")
    if "problem" in gap:
        return f"{where}: {gap['problem']}"
    if "recorded" in gap:
        return f"{where}: {gap['recorded']} recorded, the backend counted {gap.get('backend')}"
    return f"{where}: " + ", ".join(f"{k} {v}" for k, v in gap.items() if k not in ("rank", "group"))
