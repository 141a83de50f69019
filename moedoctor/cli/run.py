"""``moedoctor run``: run a job (torchrun, or any command) under the recorder and the hang watchdog."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer


from moedoctor.render.width import console as screen_console
from moedoctor.cli._command import Command
from moedoctor.cli.common import (
    DEFAULT_HANG_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    RECORDER_HELP,
    FixConfigFile,
    Force,
    StartupTimeout,
    pick_recorder,
    supervised,
)
from moedoctor.cli.hang_report import report_after_run
from moedoctor.cli.live import ConsoleObserver
from moedoctor.cli.params import print_params_check
from moedoctor.environment import DEFAULT_MAX_EVENTS, MAX_EVENTS
from moedoctor.errors import EXIT_USAGE, MoedoctorError
from moedoctor.layout import GPU, JOB_LOG, STACKS, TRACES
from moedoctor.fixes import FIXES, get_fix
from moedoctor.fixes.config import load_fix_config, write_fix_config
from moedoctor.runner import RunConfig, default_run_dir, prepare_run_dir, run_job
from moedoctor.runner.command import check_launcher, missing_script

app = typer.Typer()

EPILOG = (
    "Example: moedoctor run --hang-timeout 120 -- torchrun --nproc_per_node=8 train.py "
    "--config big.yaml.  Any command works: moedoctor run -- python train.py (mp.spawn), "
    "moedoctor run -- accelerate launch --num_processes 2 train.py, moedoctor run -- python ray_driver.py; "
    "every Python process under it loads the recorder, and each one that creates its default process group "
    "is a rank (its rank and world size from torch.distributed).  "
    "Exit status: the job's own; 124 when a hang or (online) a desync was detected and the job stopped; "
    "130 when interrupted; 2 when refused. If moedoctor is killed, the job is stopped too (not with --keep-alive)."
)


@app.command(
    cls=Command,
    context_settings={"allow_interspersed_args": False},  # the command's options are not ours
    epilog=EPILOG,
)
def run(
    command: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="-- COMMAND [ARGS]",
            help="The job's command, any command: torchrun ..., python -m torch.distributed.run ..., "
            "python train.py (mp.spawn, Lightning's launcher, a Ray driver), accelerate launch ...",
            show_default=False,
        ),
    ] = None,
    run_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--run-dir",
            help=f"Where to record the run (manifest, {TRACES}/, {STACKS}/, {GPU}/, {JOB_LOG}). Default: a "
            "new timestamped folder under ./moedoctor-runs/. A folder belongs to one job: its live moedoctor holds "
            "a lock there, and a second run of the same node is refused; another node of the same job (same "
            "command up to --node_rank) joins it: that is how every node of a multi-node job shares one run "
            "directory.",
            show_default=False,
        ),
    ] = None,
    force: Force = False,
    hang_timeout: Annotated[
        float,
        typer.Option(
            "--hang-timeout",
            min=0.1,
            metavar="SECONDS",
            help="A silence of the collectives this long is judged: it is a hang, and the job is stopped, only when "
            "ranks are proven to wait on each other (some rank waits in a collective and every rank it waits for "
            "waits too, is stopped or dead, or works with no CPU, no I/O and no new stack for this long). Ranks "
            "that are busy (saving, evaluating, compiling) are reported, never stopped.",
        ),
    ] = DEFAULT_HANG_TIMEOUT,
    max_busy: Annotated[
        float | None,
        typer.Option(
            "--max-busy",
            min=1.0,
            metavar="SECONDS",
            help="Off by default. Also stop (and diagnose) a job whose collectives stay silent this long although "
            "its ranks are busy or the hang is not proven. Risk: a healthy but slow phase longer than this (a "
            "checkpoint save, an evaluation, a first compile) is stopped.",
            show_default=False,
        ),
    ] = None,
    startup_timeout: StartupTimeout = DEFAULT_STARTUP_TIMEOUT,
    keep_alive: Annotated[
        bool,
        typer.Option("--keep-alive", metavar="", help="On a hang, collect the diagnosis but leave the job running."),
    ] = False,
    online: Annotated[
        bool,
        typer.Option(
            "--online/--no-online",
            metavar="",
            help="While the job runs, compare the ranks' collectives per group and sequence number: the first "
            "mismatch (op, shapes, dtypes), once every rank involved has issued its side, is diagnosed at once "
            "like a hang (stacks, GPU state, report; the job stopped unless --keep-alive; exit 124), without "
            "waiting for --hang-timeout. A rank a step behind its waiting group is reported, not acted on.",
        ),
    ] = True,
    exchange: Annotated[
        bool,
        typer.Option(
            "--exchange/--no-exchange",
            metavar="",
            help="Multi-node (--nnodes above 1, c10d or static rendezvous): the nodes' moedoctors exchange "
            "digests of their ranks' collectives through the job's rendezvous store (its TCPStore, keys under "
            "`moedoctor/<rdzv id>/`), so a desync across nodes is found, and the job stopped on every node, "
            "with a run directory per node (no shared file system). Needs --online.",
        ),
    ] = True,
    no_stacks: Annotated[
        bool,
        typer.Option(
            "--no-stacks",
            metavar="",
            help="On a hang, do not dump the ranks' stacks with py-spy (their process states "
            "are still read from /proc).",
        ),
    ] = False,
    native: Annotated[
        bool,
        typer.Option(
            "--native", metavar="", help="Include native (C/C++) frames in the stacks (py-spy dump --native)."
        ),
    ] = False,
    recorder: Annotated[str, typer.Option("--recorder", metavar="auto|native|python", help=RECORDER_HELP)] = "auto",
    max_events: Annotated[
        Optional[int],
        typer.Option(
            "--max-events",
            min=1,
            metavar="N",
            help=f"Stop recording a rank's collectives after N events (sets {MAX_EVENTS.name}; the "
            "coverage check then reports the drop).",
            show_default=str(DEFAULT_MAX_EVENTS),
        ),
    ] = None,
    fix: Annotated[
        Optional[list[str]],
        typer.Option(
            "--fix",
            metavar="NAME",
            help="Inject a fix module into every rank (repeatable; `moedoctor fixes` lists "
            "them). To prove a fix, use moedoctor verify.",
            show_default=False,
        ),
    ] = None,
    config: FixConfigFile = None,
    check_params: Annotated[
        bool,
        typer.Option(
            "--check-params",
            metavar="",
            help="Fingerprint every rank's parameters after the model's preparation (its first forward) and "
            "after optimizer step --check-params-step (with the optimizer state), and compare them across ranks "
            "by their layout: replicated ones that differ, sharded (or per-rank) ones a broadcast made identical "
            "(docs/analysis.md, overwritten-shards). Reported at the end; the job is never stopped for it.",
        ),
    ] = False,
    check_params_step: Annotated[
        int,
        typer.Option(
            "--check-params-step", min=1, metavar="N", help="The optimizer step --check-params fingerprints after."
        ),
    ] = 1,
) -> None:
    """Run a job (torchrun or any command), recording every collective of every rank, and diagnose it if it hangs.

    On a hang, or as soon as two ranks of a group issue different collectives (online detection),
    it writes the ranks' stacks (py-spy), a GPU snapshot (NVML) and the coverage check to the run
    directory, stops the job's whole process tree and exits 124.
    """
    command = check_launcher(list(command or []))
    fixes = tuple(get_fix(name).name for name in dict.fromkeys(fix or ()))
    fix_config = load_fix_config(config, FIXES.values()) if config is not None else {}
    if fix_config and not fixes:
        raise MoedoctorError("--config only tells fixes where your code is: name a fix with --fix")
    if check_params_step != 1 and not check_params:
        raise MoedoctorError("--check-params-step only says when --check-params fingerprints: add --check-params")
    missing = missing_script(command)
    if missing is not None:  # before any run directory is made: nothing was started
        raise MoedoctorError(f"{missing} (nothing was started)", EXIT_USAGE)
    if run_dir is None:
        run_dir = default_run_dir(Path("moedoctor-runs"))
    joined = prepare_run_dir(run_dir, command, force)
    console = screen_console(stderr=True)
    choice = pick_recorder(recorder, console)
    run_config = RunConfig(
        command=command,
        run_dir=run_dir.resolve(),
        env=dict(os.environ),
        hang_timeout=hang_timeout,
        max_busy=max_busy,
        startup_timeout=startup_timeout,
        keep_alive=keep_alive,
        online=online,
        exchange=exchange,
        stacks=not no_stacks,
        native=native,
        max_events=max_events,
        recorder=choice.kind,
        joined=joined,
        fixes=fixes,
        fix_config=write_fix_config(run_dir, fix_config),
        check_params=check_params_step if check_params else None,
    )
    observer = ConsoleObserver(console, live=sys.stdout.isatty() and sys.stderr.isatty())
    with supervised(observer):
        result = run_job(run_config, observer)
    if result.hang is not None and result.hang.stopped:
        console.print(
            f"moedoctor: the job was stopped (exit {result.exit_code}); the diagnosis is above.", highlight=False
        )
    else:
        report_after_run(result, console)
    if check_params:
        print_params_check(run_dir, console)
    raise typer.Exit(result.exit_code)
