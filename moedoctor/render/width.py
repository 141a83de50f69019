"""The width moedoctor prints at, the same for every command, its help and its reports.

On a terminal: the terminal's own width (rich measures it). Off a terminal (a pipe, a file, a CI
log): ``$COLUMNS`` when set, else ``DEFAULT_WIDTH`` (rich's own default there is 80 columns, which cut
option names in ``--help`` and wrapped one-line notices mid-phrase, while the verify table used 140).
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from rich.console import Console

#: Columns off a terminal, where nothing says how wide the reader's window is.
DEFAULT_WIDTH = 110


def screen_width(stream: IO[str] | None = None) -> int | None:
    """None on a terminal (measure it), else ``$COLUMNS`` if a positive number, else ``DEFAULT_WIDTH``."""
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return None
    except (AttributeError, ValueError):  # closed or not a real stream
        pass
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return DEFAULT_WIDTH


def console(stderr: bool = False, **kwargs: Any) -> Console:
    """A rich ``Console`` for stdout (or stderr) at ``screen_width``."""
    return Console(stderr=stderr, width=screen_width(sys.stderr if stderr else sys.stdout), **kwargs)


def help_width() -> None:
    """Make typer's ``--help`` use ``screen_width`` (unless ``$TERMINAL_WIDTH``, typer's own, says)."""
    from typer import rich_utils

    if not os.environ.get("TERMINAL_WIDTH"):
        rich_utils.MAX_WIDTH = screen_width()
