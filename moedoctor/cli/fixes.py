"""``moedoctor fixes``: the fix modules, the patterns they fix and what they patch."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from moedoctor.render.width import console as screen_console
from moedoctor.cli._command import Command
from moedoctor.fixes import FIXES

app = typer.Typer()


@app.command(cls=Command)
def fixes(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", metavar="", help="Also the mechanism, cost, risk and check.")
    ] = False,
) -> None:
    """List the fix modules `moedoctor verify --fix NAME` can inject, the deadlock patterns each
    fixes, and the classes and functions it patches (more can be named with --config)."""
    console = screen_console()
    if not console.is_terminal:  # a pipe or a file: whole names, one per line, nothing cut mid-word
        _plain(verbose)
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=True)
    for name, ratio in (("fix", 2), ("fixes pattern", 2), ("what it does", 3), ("targets", 5)):
        table.add_column(name, overflow="fold", ratio=ratio)
    for fix in FIXES.values():
        targets = "\n".join(escape(line) for line in _target_lines(fix.targets, verbose)) or "(from --config only)"
        if fix.by_structure:
            targets += "\n" + escape(f"also: {fix.by_structure}")
        table.add_row(f"[bold]{fix.name}[/]", ", ".join(fix.patterns), escape(fix.summary), targets)
    console.print(table)
    if verbose:
        for fix in FIXES.values():
            console.print(f"\n[bold]{fix.name}[/]", highlight=False)
            for label, text in (
                ("mechanism", fix.mechanism),
                ("cost", fix.cost),
                ("risk", fix.risk),
                ("checked by", fix.check),
                ("--config", fix.config_help),
            ):
                if text:
                    console.print(f"  {label}: {escape(text)}", highlight=False, soft_wrap=True)
    if not verbose:
        console.print("(-v lists every target class)", highlight=False)
    console.print(
        "Use: moedoctor verify --fix NAME --run RUN_DIR   (docs/fixes.md explains each fix)",
        highlight=False,
        soft_wrap=True,
    )


def _plain(verbose: bool) -> None:
    for fix in FIXES.values():
        typer.echo(f"{fix.name}  (fixes {', '.join(fix.patterns)})")
        typer.echo(f"  what it does: {fix.summary}")
        for line in _target_lines(fix.targets, verbose) or ["(from --config only)"]:
            typer.echo(f"  target: {line}")
        if fix.by_structure:
            typer.echo(f"  also, found by moedoctor analyze: {fix.by_structure}")
        if verbose:
            for label, text in (
                ("mechanism", fix.mechanism),
                ("cost", fix.cost),
                ("risk", fix.risk),
                ("checked by", fix.check),
                ("--config", fix.config_help),
            ):
                if text:
                    typer.echo(f"  {label}: {text}")
    typer.echo("Use: moedoctor verify --fix NAME --run RUN_DIR   (docs/fixes.md explains each fix)")


def _target_lines(targets, verbose: bool, shown: int = 3) -> list[str]:
    """Targets grouped by their note; a long group is summarized unless ``verbose``."""
    groups: dict[str, list[str]] = {}
    for target in targets:
        groups.setdefault(target.note, []).append(target.path)
    lines = []
    for note, paths in groups.items():
        if verbose or len(paths) <= shown:
            lines += [f"{path} ({note})" if note else path for path in paths]
        else:
            names = ", ".join(path.rsplit(":", 1)[-1] for path in paths[:shown])
            lines.append(f"{note}: {len(paths)} classes ({names}, ...)")
    return lines
