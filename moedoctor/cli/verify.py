"""``moedoctor verify --fix NAME``: rerun a job with fixes injected and prove that they work."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from moedoctor.render.width import console as screen_console
from moedoctor.cli._command import Command
from moedoctor.cli.common import (
    DEFAULT_STARTUP_TIMEOUT,
    FixConfigFile,
    Force,
    StartupTimeout,
    pick_recorder,
    supervised,
)
from moedoctor.cli.live import ConsoleObserver
from moedoctor.errors import EXIT_FINDING, EXIT_OK
from moedoctor.layout import RunDir
from moedoctor.render.verification import render_verification, verification_to_dict, write_verification
from moedoctor.runner import RunConfig
from moedoctor.verification import VerifyConfig, verify as verify_job
from moedoctor.verification.plan import DEFAULT_HANG_TIMEOUT, plan_verify

app = typer.Typer()

EPILOG = (
    "Examples: moedoctor verify --fix expert-dense --run moedoctor-runs/20250101-120000 | "
    "moedoctor verify --fix skip-step-collectively -- torchrun --nproc_per_node 8 train.py.  "
    "Exit status: 0 verified; 1 not verified (the table says why); 2 refused; 130 interrupted."
)


@app.command(cls=Command, context_settings={"allow_interspersed_args": False}, epilog=EPILOG)
def verify(
    command: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="[-- torchrun [TORCHRUN ARGS] SCRIPT [ARGS]]",
            help="The job to rerun, when it is not taken from --run.",
            show_default=False,
        ),
    ] = None,
    fix: Annotated[
        list[str],
        typer.Option(
            "--fix",
            metavar="NAME",
            help="A fix module to inject (repeat for several). `moedoctor fixes` lists them.",
            show_default=False,
        ),
    ] = ...,  # type: ignore[assignment]
    run: Annotated[
        Optional[Path],
        typer.Option(
            "--run",
            metavar="RUN_DIR",
            help="The run to fix (from `moedoctor run`): its command is rerun, and its "
            "hang, report, losses and step times are the 'before' column.",
            show_default=False,
        ),
    ] = None,
    config: FixConfigFile = None,
    run_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--run-dir",
            help="Where to record the rerun. Default: RUN_DIR/verify-FIXES with --run, else a new "
            "folder under ./moedoctor-runs/.",
            show_default=False,
        ),
    ] = None,
    force: Force = False,
    hang_timeout: Annotated[
        Optional[float],
        typer.Option(
            "--hang-timeout",
            min=0.1,
            metavar="SECONDS",
            help="Fail as a hang when no rank makes progress this "
            f"long. Default: the original run's, else {DEFAULT_HANG_TIMEOUT:g}.",
            show_default=False,
        ),
    ] = None,
    startup_timeout: StartupTimeout = DEFAULT_STARTUP_TIMEOUT,
    recorder: Annotated[
        str,
        typer.Option(
            "--recorder",
            metavar="auto|native|python",
            help="As for moedoctor run. Default: the original run's recorder (so step times compare), else auto.",
            show_default=False,
        ),
    ] = "",
    json_out: Annotated[
        bool, typer.Option("--json", metavar="", help="Print the verification as JSON on stdout.")
    ] = False,
) -> None:
    """Rerun the job with the named fixes injected into every rank (no change to your code) and
    prove them: the job completes, every rank issues the same collective sequence, the fix's
    numerical check holds, and the losses the original run got before it hung are reproduced.
    Prints a before/after table, including the step time with and without the fix."""
    plan = plan_verify(
        fix,
        run=run,
        command=command,
        config=config,
        run_dir=run_dir,
        force=force,
        recorder=recorder,
        hang_timeout=hang_timeout,
    )
    fixes, command, run_dir, timeout = plan.fixes, plan.command, plan.run_dir, plan.hang_timeout
    console = screen_console(stderr=True)
    choice = pick_recorder(plan.recorder, console)
    console.print(
        f"moedoctor: verifying {', '.join(fixes)}: rerunning {' '.join(command)} "
        f"(hang timeout {timeout:g}s) in {run_dir}",
        highlight=False,
        soft_wrap=True,
    )
    run_config = RunConfig(
        command=command,
        run_dir=run_dir.resolve(),
        env=dict(os.environ),
        hang_timeout=timeout,
        startup_timeout=startup_timeout,
        recorder=choice.kind,
    )
    # The rerun's own diagnosis, if it hangs again, is in its run directory; the table says what failed.
    observer = ConsoleObserver(console, live=sys.stdout.isatty() and sys.stderr.isatty(), report=False)
    try:
        with supervised(observer):
            verification = verify_job(VerifyConfig(tuple(fixes), run_config, plan.original, plan.fix_config), observer)
    except KeyboardInterrupt:
        console.print("moedoctor: interrupted; the rerun was stopped")
        raise typer.Exit(130) from None
    written = write_verification(verification, RunDir(run_dir).verification)
    if json_out:
        import json

        typer.echo(json.dumps(verification_to_dict(verification), indent=1))
    else:
        # A before/after table needs room: 140 columns when writing to a file or a pipe (rich's 80 wraps it).
        render_verification(verification, screen_console())
        console.print(f"Written: {written}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_OK if verification.passed else EXIT_FINDING)  # 1: not verified
