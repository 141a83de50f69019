"""What ``moedoctor run`` and ``moedoctor verify`` share: their common options, declared once, and
the supervision of a job from the terminal (signals, the live observer, the recorder choice)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from moedoctor.runner.launch import DEFAULT_HANG_TIMEOUT, DEFAULT_STARTUP_TIMEOUT
from moedoctor.runner.recorder_choice import RecorderChoice, choose_recorder

StartupTimeout = Annotated[
    float,
    typer.Option(
        "--startup-timeout",
        min=0.1,
        metavar="SECONDS",
        help="Before any rank has initialized its process group (imports, rendezvous), allow this long "
        "(or --hang-timeout, if longer) before declaring a hang.",
    ),
]
Force = Annotated[
    bool, typer.Option("--force", metavar="", help="Reuse a non-empty --run-dir, replacing the run recorded there.")
]
FixConfigFile = Annotated[
    Optional[Path],
    typer.Option(
        "--config",
        metavar="FILE",
        help="YAML telling the fixes where your code is (its classes and functions); see docs/fixes.md.",
        show_default=False,
    ),
]
RECORDER_HELP = (
    "The recorder the ranks use: native (a C++ kernel at the dispatcher, about 3-5 us per collective; "
    "built once per environment, which needs a C++ compiler and ninja), python (no build, tens of us "
    "per collective), or auto: native where it builds, else python."
)

__all__ = [
    "DEFAULT_HANG_TIMEOUT",
    "DEFAULT_STARTUP_TIMEOUT",
    "FixConfigFile",
    "Force",
    "RECORDER_HELP",
    "StartupTimeout",
    "pick_recorder",
    "supervised",
]


def pick_recorder(wanted: str, console: Console) -> RecorderChoice:
    """The recorder to use, saying on the screen when a build runs or ``auto`` falls back to Python."""
    choice = choose_recorder(
        wanted, lambda message: console.print(f"moedoctor: {message}", highlight=False, soft_wrap=True)
    )
    if wanted == "auto" and choice.kind == "python":
        console.print(f"moedoctor: recording with the Python kernels ({choice.note})", highlight=False, soft_wrap=True)
    return choice


@contextlib.contextmanager
def supervised(observer) -> Iterator[None]:
    """While a job runs from the terminal: a scheduler's SIGTERM or a closed terminal (SIGHUP) stops it
    as Ctrl-C does; the live observer is closed and the handlers restored afterwards."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        observer.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
