"""The live status of ``moedoctor run``: a table of every rank (a ``rich.live.Live`` on a terminal) or
one plain line (every ``LOG_EVERY`` seconds otherwise), from ``run_job``'s ``RunStatus``."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from moedoctor.run_status import RankStatus, RunStatus
from moedoctor.wording import phase_label


def status_table(status: RunStatus) -> Table:
    slow = slow_line(status).removesuffix(" | ")
    table = Table(
        title=(
            f"moedoctor: {status.elapsed:.0f}s, silent {status.idle_seconds:.0f}s, {escape(status.busy)}"
            if status.busy
            else f"moedoctor: {status.elapsed:.0f}s, idle {status.idle_seconds:.1f}s of {status.limit:.0f}s"
            + (f"; {escape(slow)}" if slow else "")
        ),
        title_justify="left",
        expand=False,
    )
    for name, justify in (
        ("rank", "right"),
        ("pid", "right"),
        ("group", "left"),
        ("seq", "right"),
        ("op", "left"),
        ("state", "left"),
        ("phase", "left"),
        ("step", "right"),
        ("idle s", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in status.ranks:
        if r.unrecorded:
            table.add_row(str(r.rank), str(r.pid or ""), "", "", "", "not recorded", "", "", "")
            continue
        if r.last is None:
            state = "starting" if r.idle_seconds is None else "initialized"
            table.add_row(str(r.rank), str(r.pid or ""), "", "", "", state, "", "", _idle(r))
            continue
        e = r.last
        table.add_row(
            str(r.rank),
            str(r.pid),
            escape(e.group.desc or e.group.name),
            str(e.seq),
            e.op,
            "done" if r.last_completed else "waiting",
            phase_label(e.phase.value),
            str(e.step),
            _idle(r),
        )
    return table


def status_line(status: RunStatus) -> str:
    parts = []
    for r in status.ranks:
        if r.unrecorded:
            parts.append(f"rank {r.rank}: recording stopped")
        elif r.last is None:
            parts.append(f"rank {r.rank}: {'starting' if r.idle_seconds is None else 'initialized'}")
        else:
            e = r.last
            parts.append(
                f"rank {r.rank}: {e.op} #{e.seq} ({e.group.desc or e.group.name}) "
                f"{'done' if r.last_completed else 'waiting'}, {phase_label(e.phase.value)}, step {e.step}, "
                f"idle {_idle(r)}s"
            )
    ranks = "; ".join(parts) or "no rank started yet"
    if all(r.last is None for r in status.ranks):  # before the first collective: the start-up limit applies
        return f"moedoctor: {status.elapsed:.0f}s, no collective yet (start-up limit {status.limit:.0f}s) | {ranks}"
    slow = slow_line(status)
    if status.busy:  # past the timeout, judged: not a hang
        return f"moedoctor: {status.elapsed:.0f}s, silent {status.idle_seconds:.0f}s, {status.busy} | {ranks}"
    return f"moedoctor: {status.elapsed:.0f}s, idle {status.idle_seconds:.0f}s of {status.limit:.0f}s | {slow}{ranks}"


def slow_line(status: RunStatus) -> str:
    """``slow, not stuck: 4,212 broadcasts from loader.py:88 in 38 s (...) | `` while a storm goes on."""
    storms = [r for r in status.ranks if r.slow and not r.unrecorded]
    return f"{max(storms, key=lambda r: r.slow_seconds).slow} | " if storms else ""


def _idle(r: RankStatus) -> str:
    return "" if r.idle_seconds is None else f"{r.idle_seconds:.1f}"
