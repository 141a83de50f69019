"""The one error type moedoctor's commands raise, and the exit statuses it documents.

Exit statuses of ``moedoctor`` commands:

- ``0``..``255`` from the job: when the job run by ``moedoctor run`` ends by itself, its own exit
  status passes through unchanged (a job killed by signal N gives ``128 + N``, as a shell would).
- ``EXIT_HANG`` (124, as ``timeout(1)`` uses): a hang, or a desync seen online, was detected and the
  job was stopped.
- ``1`` from ``moedoctor analyze`` / ``triage`` (a problem was found) and ``moedoctor verify`` (the
  fix was not verified).
- ``EXIT_USAGE`` (2): the command line or the run directory was refused; nothing was run.
- ``EXIT_INTERRUPTED`` (130): moedoctor was interrupted (Ctrl-C or SIGTERM); the job was stopped.

``moedoctor.cli.main.main`` is the one place that turns a ``MoedoctorError`` into a message on
stderr and its exit status.
"""

from __future__ import annotations

EXIT_HANG = 124
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class MoedoctorError(Exception):
    """A failure to report to the user as one message, with the exit status to leave with."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
