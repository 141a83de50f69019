"""What ``moedoctor run`` prints when it is over. ``report_after_hang(run_dir, console)`` is the one
place the post-hang report is rendered, from the run directory alone, so a fuller report (the
analyzer's) can replace it without touching the runner."""

from __future__ import annotations

import time
from pathlib import Path

from rich import box
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
        console.print(f"moedoctor: no hang recorded in {escape(str(layout.manifest))}", soft_wrap=True)
        return
    stopped = "job stopped" if hang.stopped else "job left running (--keep-alive)"
    console.print(f"\n[bold red]Hang[/]: no rank made progress for {hang.idle_seconds:.1f}s "
                  f"(hang timeout {hang.hang_timeout:g}s) on {escape(hang.host)}; {stopped}.",
                  highlight=False, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("rank", "last collective", "group", "state", "phase", "step", "call site"):
        table.add_column(name, overflow="fold")
    for r in hang.ranks:
        if r.last is None:
            table.add_row(str(r.rank), "none: no trace (stuck before init_process_group?)", "", "", "", "", "")
            continue
        last = r.last
        site = last.call_site.rsplit("/", 1)[-1] if last.call_site else "?"
        table.add_row(str(r.rank), f"{last.op} #{last.seq}", escape(last.group),
                      "done" if last.completed else "waiting", last.phase, str(last.step), escape(site))
    console.print(table)
    for r in hang.ranks:
        if r.stack_error:
            console.print(f"[yellow]rank {r.rank}:[/] {escape(r.stack_error)}", highlight=False,
                          soft_wrap=True)
        elif r.waiting_in:
            where = r.waiting_in if r.user_frame in (None, r.waiting_in) else f"{r.waiting_in} <- {r.user_frame}"
            console.print(f"rank {r.rank} main thread waits in {escape(where)}", highlight=False, soft_wrap=True)
    coverage = manifest.get("coverage") or {}
    _print_coverage(coverage, console)
    console.print(f"Written: {escape(str(layout.stacks))}/  {escape(str(layout.gpu))}/  "
                  f"{escape(str(layout.manifest))}  {escape(str(layout.job_log))}", highlight=False, soft_wrap=True)
    console.print(f"Next: [bold]moedoctor analyze {escape(str(layout.path))}[/]", highlight=False, soft_wrap=True)


def report_after_run(result: RunResult, console: Console) -> None:
    """The job ended by itself, or moedoctor was interrupted."""
    layout = result.run_dir
    if result.job_exit is None:
        console.print(f"moedoctor: interrupted; the job was stopped (exit {result.exit_code})", soft_wrap=True)
    else:
        console.print(f"moedoctor: the job exited with status {result.exit_code}", soft_wrap=True)
    if result.hang is not None:
        console.print(f"A hang was diagnosed at {time.strftime('%H:%M:%S', time.localtime(result.hang.detected_at))}"
                      " and the job left running (--keep-alive); see the manifest's hang record.", soft_wrap=True)
    if result.coverage is not None:
        _print_coverage({"complete": result.coverage.complete, "gaps": result.coverage.gaps}, console)
    console.print(f"Run recorded in {escape(str(layout.path))}; next: "
                  f"[bold]moedoctor analyze {escape(str(layout.path))}[/]", highlight=False, soft_wrap=True)


def _print_coverage(coverage: dict, console: Console) -> None:
    if not coverage:
        return
    if coverage.get("complete"):
        console.print("Coverage: complete (every group's recorded count matches the backend's counter)")
        return
    gaps = coverage.get("gaps", [])
    console.print(f"[yellow]Coverage: {len(gaps)} gap(s)[/]", highlight=False, soft_wrap=True)
    for gap in gaps[:10]:
        console.print(f"  {escape(str(gap))}", highlight=False, soft_wrap=True)
