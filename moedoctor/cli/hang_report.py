"""What ``moedoctor run`` prints when it is over. ``report_after_hang(run_dir, console)`` is the one
place the post-hang report is rendered, from the run directory alone, so a fuller report (the
analyzer's) can replace it without touching the runner."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moedoctor.runner import RunResult
from moedoctor.runner.manifest import hang_of, load_manifest
from moedoctor.runner.rundir import RunDir


def report_after_hang(run_dir: Path, console: Console) -> None:
    """Per rank: the last collective and where the main thread waits; the files written; what next."""
    layout = RunDir(Path(run_dir))
    manifest = load_manifest(layout.manifest)
    hang = hang_of(manifest)
    if hang is None:
        console.print(f"moedoctor: no hang recorded in {layout.manifest}")
        return
    stopped = "job stopped" if hang.stopped else "job left running (--keep-alive)"
    console.print(f"\n[bold red]Hang[/]: no rank made progress for {hang.idle_seconds:.1f}s "
                  f"(hang timeout {hang.hang_timeout:g}s) on {escape(hang.host)}; {stopped}.", highlight=False)
    table = Table(show_lines=False)
    for name in ("rank", "last collective", "state", "call site", "phase", "step", "main thread waits in"):
        table.add_column(name)
    for r in hang.ranks:
        waits = " <- ".join(str(x) for x in (r.waiting_in, r.user_frame) if x and r.waiting_in != r.user_frame)
        waits = waits or r.waiting_in or ("(no stack)" if r.stack_error else "")
        if r.last is None:
            table.add_row(str(r.rank), "none (no trace: stuck before init_process_group?)", "", "", "", "",
                          escape(waits))
            continue
        last = r.last
        table.add_row(str(r.rank), escape(f"{last.op} #{last.seq} in group {last.group}"),
                      "done" if last.completed else "waiting", escape(last.call_site or "?"), last.phase,
                      str(last.step), escape(waits))
    console.print(table)
    for r in hang.ranks:
        if r.stack_error:
            console.print(f"[yellow]rank {r.rank}:[/] {escape(r.stack_error)}", highlight=False)
    coverage = manifest.get("coverage") or {}
    _print_coverage(coverage, console)
    console.print(f"Written: {escape(str(layout.stacks))}/  {escape(str(layout.gpu))}/  "
                  f"{escape(str(layout.manifest))}  {escape(str(layout.job_log))}", highlight=False)
    console.print(f"Next: [bold]moedoctor analyze {escape(str(layout.path))}[/]", highlight=False)


def report_after_run(result: RunResult, console: Console) -> None:
    """The job ended by itself, or moedoctor was interrupted."""
    layout = result.run_dir
    if result.job_exit is None:
        console.print(f"moedoctor: interrupted; the job was stopped (exit {result.exit_code})")
    else:
        console.print(f"moedoctor: the job exited with status {result.exit_code}")
    if result.coverage is not None:
        _print_coverage({"complete": result.coverage.complete, "gaps": result.coverage.gaps}, console)
    console.print(f"Run recorded in {escape(str(layout.path))}; next: "
                  f"[bold]moedoctor analyze {escape(str(layout.path))}[/]", highlight=False)


def _print_coverage(coverage: dict, console: Console) -> None:
    if not coverage:
        return
    if coverage.get("complete"):
        console.print("Coverage: complete (every group's recorded count matches the backend's counter)")
        return
    gaps = coverage.get("gaps", [])
    console.print(f"[yellow]Coverage: {len(gaps)} gap(s)[/]", highlight=False)
    for gap in gaps[:10]:
        console.print(f"  {escape(str(gap))}", highlight=False)
