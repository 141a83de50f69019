"""What ``moedoctor run`` prints when it is over. ``report_after_hang(run_dir, console)`` is the one
place the post-hang report is rendered, from the run directory alone: the analysis report
(``moedoctor.analysis``), also written to ``RUN_DIR/report.json`` (the schema of
``moedoctor analyze --json``). A job that ends by itself is analyzed too: a crashed rank gets the
full report, a healthy run one line."""

from __future__ import annotations

import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moedoctor.wording import phase_label
from moedoctor.analysis import Verdict, analyze, load_run
from moedoctor.analysis.load import verdict_problem
from moedoctor.errors import MoedoctorError, cannot_write
from moedoctor.fixes.reach import with_fix_reach
from moedoctor.render.json_report import write_json
from moedoctor.render.terminal import render_report, render_slow
from moedoctor.runner import RunResult
from moedoctor.manifest_format import Manifest
from moedoctor.runner.exchange import store_of
from moedoctor.runner.ranks import unknown_exits_line
from moedoctor.runner.rundir import RunDir
from moedoctor.trace.format import STOPPED, read_statuses
from moedoctor.trace.reader import trace_paths


def report_after_hang(run_dir: Path, console: Console) -> None:
    """The hang in one line, then the analysis report; ``report.json`` written into the run directory.
    If the analysis cannot run, the per-rank table of the watchdog's hang record instead."""
    layout = RunDir(Path(run_dir))
    manifest = Manifest.read(layout.manifest)
    hang = manifest.hang
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
    written = analysis_report(layout, console)
    if written is None:
        _hang_table(hang, console)
    _print_coverage(manifest.coverage or {}, console)
    files = [f"{layout.stacks}/", f"{layout.gpu}/", str(layout.manifest), str(layout.job_log)]
    if written is not None:
        files.insert(0, str(written))
    console.print("Written: " + "  ".join(escape(f) for f in files), highlight=False, soft_wrap=True)
    console.print(
        f"Next: [bold]moedoctor analyze {escape(str(layout.path))}[/] (add --html FILE or --perfetto FILE)",
        highlight=False,
        soft_wrap=True,
    )
    _other_nodes_note(layout, manifest, console)


def _other_nodes_note(layout: RunDir, manifest: Manifest, console: Console) -> None:
    """A node of a multi-node job with a run directory of its own holds its own ranks' traces only:
    say how to analyze the whole job."""
    world, command = manifest.world_size, manifest.command
    traced = len(trace_paths(layout.traces)) if layout.traces.is_dir() else 0
    if not isinstance(world, int) or traced >= world or not isinstance(command, list) or store_of(command) is None:
        return
    console.print(
        f"This node's run directory holds {traced} of the job's {world} ranks (a run directory per node): "
        f"for the whole job, gather the nodes' run directories and run [bold]moedoctor analyze "
        f"{escape(str(layout.path))} OTHER_NODE_RUN_DIR ...[/]",
        highlight=False,
        soft_wrap=True,
    )


def analysis_report(layout: RunDir, console: Console, quiet_if_healthy: bool = False) -> Path | None:
    """Analyze the run directory, render the report and write ``report.json``; the path written, or
    None when the analysis could not run (the reason is printed)."""
    try:
        run = load_run(layout.path)
        report = with_fix_reach(analyze(run), run)
        problem = verdict_problem(run, report.verdict)
        if problem is not None:  # never "Healthy: 0 collectives" for a job that never started
            raise MoedoctorError(problem)
        try:
            path = write_json(report, layout.report)
        except OSError as e:  # disk full: the report is still shown
            console.print(
                f"[yellow]moedoctor: {escape(cannot_write(layout.report, e, 'the report is shown only'))}[/]",
                highlight=False,
                soft_wrap=True,
            )
            path = None
    except MoedoctorError as e:
        console.print(f"[yellow]moedoctor: no analysis:[/] {escape(e.message)}", highlight=False, soft_wrap=True)
        return None
    except Exception as e:  # noqa: BLE001 - the run's own result must still be reported
        console.print(
            f"[yellow]moedoctor: the analysis failed ({escape(type(e).__name__)}: {escape(str(e))}); "
            f"the run is recorded, try: moedoctor analyze {escape(str(layout.path))}[/]",
            highlight=False,
            soft_wrap=True,
        )
        return None
    if quiet_if_healthy and report.verdict == Verdict.HEALTHY:
        console.print(f"[green]Analysis[/]: {escape(report.summary)}", highlight=False, soft_wrap=True)
        render_slow(report, console)  # a healthy job can still be slow: say where its time went
    else:
        render_report(report, console)
    return path


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
        unknown = unknown_exits_line(layout.manifest) if result.exit_code != 0 else None
        if unknown is not None:  # a failed job whose failed ranks cannot be named from their exits
            console.print(f"moedoctor: {unknown}", soft_wrap=True, highlight=False)
    if result.hang is not None:
        console.print(
            f"A hang was diagnosed at {time.strftime('%H:%M:%S', time.localtime(result.hang.detected_at))}"
            " and the job left running (--keep-alive); see the manifest's hang record.",
            soft_wrap=True,
        )
    stopped = sorted(r for r, status in read_statuses(layout.traces).items() if status["state"] == STOPPED)
    if stopped:  # the traces end before the job did: no verdict from them (docs/guarantees.md)
        console.print(
            f"[yellow]moedoctor: the recording stopped on rank{'s' if len(stopped) > 1 else ''} "
            f"{','.join(map(str, stopped[:20]))}{' ...' if len(stopped) > 20 else ''} (one of its writes "
            "failed, said above): the traces end before the job did, so the run is not analyzed[/]",
            highlight=False,
            soft_wrap=True,
        )
    elif result.coverage is not None and any(layout.traces.glob("rank-*.jsonl")):  # nothing to cover otherwise
        _print_coverage({"complete": result.coverage.complete, "gaps": result.coverage.gaps}, console)
    if result.job_exit is not None and not stopped:  # ended by itself: explain it (a crash, or confirm healthy)
        written = analysis_report(layout, console, quiet_if_healthy=True)
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
