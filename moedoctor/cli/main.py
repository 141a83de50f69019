"""The ``moedoctor`` application: subcommands are joined here, and ``main`` is the one place that
turns a ``MoedoctorError`` into a message on stderr and its exit status, and any other exception
(moedoctor's own bug) into one line and ``EXIT_INTERNAL`` (3)."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

import moedoctor
from moedoctor import environment
from moedoctor.cli import analyze, fixes, run, triage, verify
from moedoctor.cli._command import Group
from moedoctor.errors import EXIT_INTERNAL, MoedoctorError, internal_error_line
from moedoctor.render.width import console, help_width

app = typer.Typer(
    cls=Group,
    name="moedoctor",
    help="A doctor for distributed PyTorch jobs that hang: record every collective, detect the hang, "
    "collect stacks and GPU state, explain it.",
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)
# One Typer per subcommand module, merged into the top level (``moedoctor run``, ...).
for module in (run, analyze, verify, fixes, triage):
    app.add_typer(module.app)


def _version(value: bool) -> None:
    if value:
        print(f"moedoctor {moedoctor.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        metavar="",
        callback=_version,
        is_eager=True,
        help="Print moedoctor's version and exit.",
    ),
) -> None:
    """moedoctor: find, explain and fix collective deadlocks in distributed PyTorch jobs."""


def main(argv: list[str] | None = None) -> None:
    help_width()
    try:
        app(args=argv, prog_name="moedoctor")
    except MoedoctorError as e:
        console(stderr=True).print(f"[bold red]moedoctor:[/] {escape(e.message)}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - moedoctor's own bug: one line and exit 3, never a traceback
        if environment.debug():
            raise
        console(stderr=True).print(
            f"[bold red]moedoctor:[/] {escape(internal_error_line(e))}", highlight=False, soft_wrap=True
        )
        sys.exit(EXIT_INTERNAL)
