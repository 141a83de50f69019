"""``moedoctor fixes``: the fix modules, the patterns they fix and what they patch."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moedoctor.fixes import FIXES

app = typer.Typer()


@app.command()
def fixes(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also the mechanism, cost, risk and check.")] = False,
) -> None:
    """List the fix modules `moedoctor verify --fix NAME` can inject, the deadlock patterns each
    fixes, and the classes and functions it patches (more can be named with --config)."""
    console = Console()
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=True)
    for name in ("fix", "fixes pattern", "what it does", "targets"):
        table.add_column(name, overflow="fold")
    for fix in FIXES.values():
        targets = "\n".join(escape(t.describe()) for t in fix.targets) or "(from --config only)"
        table.add_row(f"[bold]{fix.name}[/]", ", ".join(fix.patterns), escape(fix.summary), targets)
    console.print(table)
    if verbose:
        for fix in FIXES.values():
            console.print(f"\n[bold]{fix.name}[/]", highlight=False)
            for label, text in (("mechanism", fix.mechanism), ("cost", fix.cost), ("risk", fix.risk),
                                ("checked by", fix.check), ("--config", fix.config_help)):
                if text:
                    console.print(f"  {label}: {escape(text)}", highlight=False, soft_wrap=True)
    console.print("Use: moedoctor verify --fix NAME --run RUN_DIR   (docs/fixes.md explains each fix)",
                  highlight=False, soft_wrap=True)
