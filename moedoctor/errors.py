"""The one error type moedoctor's commands raise, and the exit statuses it documents (the one place
they are defined; docs/guarantees.md lists them too).

Exit statuses of ``moedoctor analyze`` / ``triage`` (and of the library's errors):

- ``EXIT_OK`` (0): healthy, with evidence: a readable trace of every rank that ran.
- ``EXIT_FINDING`` (1): a desync, a stuck job or a crashed rank was found (``moedoctor verify``:
  the fix was not verified).
- ``EXIT_BAD_INPUT`` (2, also ``EXIT_USAGE``): the command line, the run directory or the input was
  refused or cannot back a verdict (unreadable, foreign, too large, a rank's trace missing, a run
  interrupted before it ended with nothing wrong up to then: verdict ``interrupted``, whose report is
  printed first); nothing was run. The reason is one line on stderr.
- ``EXIT_INTERNAL`` (3): an unexpected exception inside moedoctor itself; one line on stderr naming
  the exception and, when known, the file being read. Never a traceback (``MOEDOCTOR_DEBUG=1``
  re-raises it).

``moedoctor run`` passes the job's own status through (``0``..``255``; a job killed by signal N gives
``128 + N``, as a shell would), and adds:

- ``EXIT_HANG`` (124, as ``timeout(1)`` uses): a hang, or a desync seen online, was detected and the
  job was stopped.
- ``EXIT_INTERRUPTED`` (130): moedoctor was interrupted (Ctrl-C or SIGTERM); the job was stopped.
- ``EXIT_USAGE`` (2): refused (e.g. the run directory belongs to another live run); nothing was run.

``moedoctor.cli.main.main`` is the one place that turns a ``MoedoctorError`` (or an unexpected
exception) into a message on stderr and its exit status.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path

from moedoctor import environment

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_BAD_INPUT = 2
EXIT_USAGE = EXIT_BAD_INPUT
EXIT_INTERNAL = 3
EXIT_HANG = 124
EXIT_INTERRUPTED = 130

#: Attribute set on an unexpected exception raised while a file was being read (``reading``).
_FILE_ATTR = "_moedoctor_file"


class MoedoctorError(Exception):
    """A failure to report to the user as one message, with the exit status to leave with."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


@contextlib.contextmanager
def reading(path: Path | str) -> Iterator[None]:
    """Tag an unexpected exception raised inside with the file being read (the innermost wins), so
    that the internal-error message can name it."""
    try:
        yield
    except MoedoctorError:
        raise
    except Exception as e:
        if getattr(e, _FILE_ATTR, None) is None:
            try:
                setattr(e, _FILE_ATTR, str(path))
            except Exception:  # noqa: BLE001 - an exception type without a __dict__
                pass
        raise


def file_of(e: BaseException) -> str | None:
    """The file an unexpected exception was raised reading, if ``reading`` tagged it."""
    value = getattr(e, _FILE_ATTR, None)
    return value if isinstance(value, str) else None


def internal_error_line(e: BaseException, limit: int = 300) -> str:
    """One bounded line for an unexpected exception: never the repr of an unbounded value."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001
        text = "?"
    text = " ".join(text[:limit].split()) + ("..." if len(text) > limit else "")
    where = file_of(e)
    where = f" while reading {where[:500]}" if where else ""
    debug = environment.DEBUG.name
    return f"internal error{where}: {type(e).__name__}: {text} (a bug in moedoctor; {debug}=1 shows the traceback)"


def errno_text(number) -> str:
    """``errno 28 ENOSPC``; ``an OSError`` without a number."""
    if not isinstance(number, int) or isinstance(number, bool):
        return "an OSError"
    return f"errno {number} {errno.errorcode.get(number, '')}".strip()


def cannot_write(path: Path | str, error: OSError, then: str = "the job goes on") -> str:
    """One of moedoctor's own writes failed, in one line: ``cannot write manifest.json: No space
    left on device (errno 28 ENOSPC); the job goes on``."""
    return f"cannot write {Path(path).name}: {error.strerror or error} ({errno_text(error.errno)}); {then}"
