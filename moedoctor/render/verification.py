"""A ``Verification`` as a before/after table on the terminal, or as JSON (``verify --json``,
``verification.json`` in the rerun's directory; documented in ``docs/fixes.md``)."""

from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import moedoctor
from moedoctor.render.json_report import report_to_dict
from moedoctor.verification import Verification

SCHEMA_VERSION = 1


def render_verification(v: Verification, console: Console) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_lines=False, expand=True)
    table.add_column("check", overflow="fold", ratio=2)
    table.add_column("before" + (f" ({v.original.name})" if v.original else ""), overflow="fold", ratio=3)
    table.add_column(f"after: --fix {' --fix '.join(v.fixes)}", overflow="fold", ratio=4)
    table.add_column("", no_wrap=True)
    for c in v.checks:
        mark = "[green]PASS[/]" if c.passed else "[red]FAIL[/]" if c.failed else "[dim]info[/]"
        table.add_row(escape(c.name), escape(c.before), escape(c.after), mark)
    console.print(table)
    for c in v.checks:
        if c.detail and not c.failed:
            console.print(f"  [dim]{escape(c.name)}: {escape(c.detail)}[/]", highlight=False, soft_wrap=True)
    if v.passed:
        console.print(
            f"[bold green]VERIFIED[/]: {escape(', '.join(v.fixes))} fixes the job: it completes, every "
            "rank issues the same collectives, and the numbers hold.",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(f"[bold red]NOT VERIFIED[/]: {escape(', '.join(v.fixes))}", highlight=False, soft_wrap=True)
        for reason in v.reasons:
            console.print(f"  - {escape(reason)}", highlight=False, soft_wrap=True)
    console.print(
        f"Rerun recorded in {escape(str(v.run_dir))} (moedoctor analyze {escape(str(v.run_dir))})",
        highlight=False,
        soft_wrap=True,
    )


def verification_to_dict(v: Verification) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "moedoctor_version": moedoctor.__version__,
        "passed": v.passed,
        "fixes": list(v.fixes),
        "command": v.command,
        "run_dir": str(v.run_dir),
        "original": None if v.original is None else str(v.original),
        "reasons": v.reasons,
        "checks": [
            {
                "name": c.name,
                "passed": c.passed,
                "required": c.required,
                "failed": c.failed,
                "before": c.before,
                "after": c.after,
                "detail": c.detail,
            }
            for c in v.checks
        ],
        "exit_code": v.result.exit_code,
        "losses": None
        if v.losses is None
        else {
            "compared": v.losses.compared,
            "matched": v.losses.matched,
            "worst_relative": v.losses.worst_relative,
            "mismatches": list(v.losses.mismatches),
        },
        "step_time": None
        if v.step_times is None
        else {
            "steps": list(v.step_times.steps),
            "before_s": v.step_times.before,
            "after_s": v.step_times.after,
            "after_all_steps_s": v.step_times.after_all,
            "change": v.step_times.change,
        },
        "report": None if v.report is None else report_to_dict(v.report),
    }


def write_verification(v: Verification, path: Path) -> Path:
    path.write_text(json.dumps(verification_to_dict(v), indent=1))
    return path
