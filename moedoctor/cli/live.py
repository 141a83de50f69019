"""What ``moedoctor run`` shows while the job runs: the job's own output, passed through, and a
status of every rank on stderr (a ``rich.live.Live`` table on a terminal, a plain line every
``LOG_EVERY`` seconds otherwise; both drawn by ``render/status.py``)."""

from __future__ import annotations

import codecs
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.markup import escape

from moedoctor.layout import JOB_LOG
from moedoctor.cli.hang_report import report_after_hang
from moedoctor.runner import Outcome, RunDir, RunObserver, RunStatus
from moedoctor.render.status import slow_line, status_line, status_table  # noqa: F401 - re-exported
from moedoctor.runner.manifest import HangRecord
from moedoctor.rank_states import Judgement
from moedoctor.runner.online import Desync, Lag

LOG_EVERY = 10.0


class ConsoleObserver(RunObserver):
    """Renders ``run_job``'s progress to a stderr console; passes the job's output through."""

    def __init__(self, console: Console, live: bool, report: bool = True):
        self.console = console
        self.report = report  # print the diagnosis as soon as it is written (before the job is stopped)
        self.use_live = live
        self.live: Live | None = None
        self.run_dir: RunDir | None = None
        self.last_line = 0.0
        self.muted = False  # once the job is being stopped, its dying words go to job.log only
        self.desync: Desync | None = None
        self.storm: str | None = None  # the call site of the storm of small collectives said last
        self.busy_said: str | None = None  # the busy account said last
        self.decoders = {
            1: codecs.getincrementaldecoder("utf-8")("replace"),
            2: codecs.getincrementaldecoder("utf-8")("replace"),
        }

    def started(self, run_dir: RunDir, launcher_pid: int, joined: bool) -> None:
        self.run_dir = run_dir
        verb = "joined the run in" if joined else "recording into"
        self.console.print(
            f"[bold]moedoctor:[/] {verb} {escape(str(run_dir.path))} (launcher pid {launcher_pid})",
            highlight=False,
            soft_wrap=True,
        )
        if self.use_live:
            # Redirected, the job's output scrolls above the table instead of tearing it.
            self.live = Live(
                console=self.console,
                refresh_per_second=2,
                redirect_stdout=True,
                redirect_stderr=True,
                auto_refresh=False,
            )
            self.live.start()
        self.last_line = time.monotonic()

    def output(self, data: bytes, stream: int) -> None:
        if self.muted:
            return
        if self.live is not None:
            out = sys.stdout if stream == 1 else sys.stderr
            out.write(self.decoders[stream].decode(data))
            out.flush()
        else:
            out = sys.stdout.buffer if stream == 1 else sys.stderr.buffer
            out.write(data)
            out.flush()

    def status(self, status: RunStatus) -> None:
        slow = slow_line(status).removesuffix(" | ")
        storm = slow.split(" in ")[0].split(" from ", 1)[-1] if slow else None  # "train.py:38"
        if storm is not None and storm != self.storm:  # once per storm, between the job's lines
            self._say(f"[yellow]moedoctor: {escape(slow)}[/] (collectives complete: no hang is declared)")
        self.storm = storm
        if self.live is not None:
            self.live.update(status_table(status), refresh=True)
        elif time.monotonic() - self.last_line >= LOG_EVERY:
            self.last_line = time.monotonic()
            self.console.print(status_line(status), highlight=False, markup=False, soft_wrap=True)

    def hang_detected(self, status: RunStatus, proof: str | None = None) -> None:
        self._stop_live(status)
        self.console.print(
            f"[bold red]moedoctor: hang[/]: no rank issued or completed a collective for "
            f"{status.idle_seconds:.1f}s" + (f": {escape(proof)}" if proof else "") + "; collecting stacks, GPU "
            "state and coverage...",
            highlight=False,
            soft_wrap=True,
        )

    def desync_detected(self, desync: Desync, status: RunStatus) -> None:
        self.desync = desync
        self._stop_live(status)
        self.console.print(
            f"[bold red]moedoctor: desync[/]: {escape(desync.line())} "
            f"({desync.latency:.1f}s after it was issued); collecting stacks, GPU state and "
            "coverage...",
            highlight=False,
            soft_wrap=True,
        )

    def busy(self, judgement: Judgement) -> None:
        """Said once per silence (and again when what the ranks do changes); the status line keeps it."""
        key = judgement.kind.value + judgement.line.split(" (", 1)[0]
        if key != self.busy_said:
            self.busy_said = key
            self._say(f"[yellow]moedoctor: {escape(judgement.line)}[/] (not stuck: the job is not stopped)")

    def lag_detected(self, lag: Lag) -> None:
        self._say(f"[yellow]moedoctor: lag[/]: {escape(lag.line())} (a straggler or a desync; watching on)")

    def recording_stopped(self, line: str) -> None:
        self._say(f"[yellow]moedoctor: {escape(line)}[/]")

    def write_failed(self, line: str) -> None:
        self._say(f"[yellow]moedoctor: {escape(line)}[/]")

    def _say(self, message: str) -> None:
        """One line between the job's output, above the live table if there is one."""
        console = self.live.console if self.live is not None else self.console
        console.print(message, highlight=False, soft_wrap=True)

    def diagnosed(self, hang: HangRecord) -> None:
        # Now, not after the job is stopped: stopping takes seconds the user should not wait for.
        if self.report:
            report_after_hang(self.run_dir.path, self.console)

    def stopping(self, outcome: Outcome) -> None:
        self._stop_live(None)
        why = "interrupted" if outcome == Outcome.INTERRUPTED else "desync" if self.desync else "hang"
        self.muted = True
        self.console.print(
            f"[bold]moedoctor:[/] {why}: stopping the job's processes (SIGTERM, then SIGKILL); "
            f"their last output goes to {JOB_LOG}",
            highlight=False,
            soft_wrap=True,
        )

    def close(self) -> None:
        self._stop_live(None)

    def _stop_live(self, last: RunStatus | None) -> None:
        if self.live is not None:
            if last is not None:
                self.live.update(status_table(last), refresh=True)
            self.live.stop()
            self.live = None
