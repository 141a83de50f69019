"""``moedoctor verify --fix NAME``: rerun a job with fixes injected and prove that they work."""

from __future__ import annotations

import os
import re
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
from moedoctor.errors import EXIT_FINDING, EXIT_OK, MoedoctorError
from moedoctor.fixes import FIXES, get_fix
from moedoctor.layout import RunDir
from moedoctor.fixes.config import load_fix_config, validate_fix_config
from moedoctor.render.verification import render_verification, verification_to_dict, write_verification
from moedoctor.runner import RunConfig, default_run_dir, prepare_run_dir
from moedoctor.runner.command import check_torchrun
from moedoctor.verification import VerifyConfig, load_original, verify as verify_job

app = typer.Typer()

DEFAULT_HANG_TIMEOUT = 60.0

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
    fixes = [get_fix(name).name for name in dict.fromkeys(fix)]
    original = load_original(run) if run is not None else None
    command = list(command or [])
    if original is not None and command:
        raise MoedoctorError("give either --run RUN_DIR or the command after --, not both")
    if original is None and not command:
        raise MoedoctorError(
            "nothing to rerun: give --run RUN_DIR (a run of moedoctor run) or the command "
            "after --, e.g. moedoctor verify --fix NAME -- torchrun --nproc_per_node 2 train.py"
        )
    command = check_torchrun(original.command if original else command)
    fix_config = load_fix_config(config, FIXES.values()) if config is not None else {}
    derived = (original.report or {}).get("fix_config") if original is not None and config is None else None
    if derived:
        # The settings the analysis derived from this job's code (the decision's `if`), for the fixes asked for.
        fix_config = validate_fix_config(
            {k: v for k, v in derived.items() if k in fixes},
            FIXES.values(),
            f"{RunDir(original.path).report} fix_config",
        )
    if run_dir is None:
        run_dir = _default_rerun_dir(original.path, fixes) if original else default_run_dir(Path("moedoctor-runs"))
    prepare_run_dir(run_dir, command, force)
    console = screen_console(stderr=True)
    wanted = recorder or (original.manifest.recorder if original else None) or "auto"
    choice = pick_recorder(wanted, console)
    timeout = hang_timeout or (original.hang_timeout if original else None) or DEFAULT_HANG_TIMEOUT
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
            verification = verify_job(VerifyConfig(tuple(fixes), run_config, original, fix_config), observer)
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


def _default_rerun_dir(original: Path, fixes: list[str]) -> Path:
    base = original / ("verify-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", "+".join(fixes)))
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
