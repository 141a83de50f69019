"""The report on a terminal (rich): a verdict panel, the ranks' collectives side by side around the
divergence, the evidence, the fix with its verify command, and the code-level suggestion."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moedoctor.analysis.model import AlignedRow, DivergenceKind, OpView, Report, Verdict
from moedoctor.analysis.evidence.timing import direct_call, megabytes
from moedoctor.wording import phase_label, rank_names

_VERDICT_STYLE = {
    Verdict.HEALTHY: "green",
    Verdict.DESYNC: "red",
    Verdict.STUCK: "yellow",
    Verdict.CRASHED: "red",
    Verdict.SLOW: "yellow",
    Verdict.INTERRUPTED: "yellow",
}
_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "i64",
    "int32": "i32",
    "uint8": "u8",
    "int8": "i8",
    "bool": "bool",
}


def render_report(report: Report, console: Console) -> None:
    style = _VERDICT_STYLE[report.verdict]
    console.print(
        Panel(
            Text(report.summary),
            title=f"[bold]moedoctor: {report.verdict.value.upper()}[/]",
            title_align="left",
            border_style=style,
            expand=True,
        )
    )
    if report.verdict in (Verdict.HEALTHY, Verdict.INTERRUPTED):
        render_slow(report, console)
        render_busy(report, console)
        _incomplete(report, console)
        return
    if report.mechanism is not None:
        mech = Text("Mechanism: ", style="bold").append(report.mechanism.mechanism.value, style=f"bold {style}")
        console.print(mech.append(f"  {report.mechanism.detail}"), soft_wrap=True)
    head = Text()
    if report.pattern:
        head.append("Pattern: ", style="bold").append(f"{report.pattern_title} ", style=f"bold {style}")
        head.append(f"({report.pattern})")
    else:
        head.append("Pattern: ", style="bold").append("none identified")
    head.append("    Culprit: ", style="bold")
    if report.culprit_ranks:
        head.append(_ranks(report.culprit_ranks), style="bold")
    else:
        head.append("none")
    console.print(head)
    console.print(Text("  " + report.culprit_reasoning, style="dim"), soft_wrap=True)
    if report.alignment:
        console.print(alignment_table(report))
    if report.evidence:
        console.print(Text("Evidence", style="bold"))
        for line in report.evidence:
            console.print(Text("  • " + line), soft_wrap=True)
    if report.wait_for and (report.cycle or len(report.wait_for) > 1 or report.divergence is None):
        console.print(Text("Wait-for" + (" (cycle)" if report.cycle else ""), style="bold"))
        edges = report.cycle or report.wait_for
        for e in edges[:8]:
            console.print(
                Text(f"  rank {e.rank} waits in {e.op} #{e.seq} of group {e.group} for {_ranks(e.waits_for)}"),
                soft_wrap=True,
            )
        if len(edges) > 8:
            console.print(Text(f"  ... {len(edges) - 8} more (see --json)", style="dim"))
    _fix(report, console)
    others = [
        d
        for d in report.groups
        if report.divergence is None or d.group.name != report.divergence.group.name or d.seq != report.divergence.seq
    ]
    if others:
        console.print(Text("Other groups", style="bold"))
        for d in others[:8]:
            console.print(Text(f"  {d.describe()} (classes {', '.join(_ranks(c) for c in d.classes)})"), soft_wrap=True)
    render_slow(report, console)
    render_busy(report, console)
    _incomplete(report, console)


def render_busy(report: Report, console: Console) -> None:
    """The "Busy, not stuck" section: silences of the collectives that were not hangs, and why."""
    if not report.busy:
        return
    console.print(Text("Busy, not stuck (the job was not stopped for these)", style="bold yellow"))
    for b in report.busy[:8]:
        state = "" if b.ended else " (still so when the run ended)"
        console.print(Text(f"  • {b.seconds:.0f} s without a collective{state}: {b.line}"), soft_wrap=True)
    if len(report.busy) > 8:
        console.print(Text(f"  ... {len(report.busy) - 8} more (see --json)", style="dim"))


def render_slow(report: Report, console: Console) -> None:
    """The "Slow, not stuck" section: storms of small collectives, their expected gain, time by phase."""
    slow = report.slow
    if slow is None:
        return
    console.print(Text("Slow, not stuck (broadcast-storm)", style="bold yellow"))
    for s in slow.storms[:8]:
        console.print(Text(f"  • {s.line()} ({_ranks(s.ranks)})"), soft_wrap=True)
        console.print(
            Text(
                f"    coalescing: about {s.gain.coalesced_s:.2f} s instead of {s.seconds:.1f} s "
                f"(saves {s.gain.gain_s:.1f} s); {s.gain.method}",
                style="dim",
            ),
            soft_wrap=True,
        )
        if s.gain.weak:
            console.print(Text(f"    weak estimate: {s.gain.weak}", style="yellow"), soft_wrap=True)
    if len(slow.storms) > 8:
        console.print(Text(f"  ... {len(slow.storms) - 8} more (see --json)", style="dim"))
    if any(s.latency_bound and s.op == "broadcast" for s in slow.storms):
        targets = ((report.fix_config or {}).get("coalesce-broadcasts") or {}).get("targets") or []
        if not targets and any(direct_call(s) is False for s in slow.storms):
            console.print(
                Text(
                    "  The broadcasts are issued inside a library call at that line (which may read each result at "
                    "once), so coalesce-broadcasts cannot defer them: send the state dict yourself with "
                    "dist._broadcast_coalesced (500 MB buckets), then load it locally.",
                    style="yellow",
                ),
                soft_wrap=True,
            )
        else:
            line = Text("  Fix: ", style="bold").append("coalesce-broadcasts", style="bold green")
            line.append(f" (bucketed broadcasts inside {', '.join(targets)})" if targets else " (bucketed broadcasts)")
            console.print(line, soft_wrap=True)
        if targets and report.verify_command and "coalesce-broadcasts" in report.verify_command:
            console.print(
                Text("  prove it: ", style="bold").append(report.verify_command, style="bold"), soft_wrap=True
            )
        elif not targets and not any(direct_call(s) is False for s in slow.storms):
            console.print(
                Text(
                    "  name the loading function with --config (docs/fixes.md): coalesce-broadcasts: {targets: "
                    "['module:function']}",
                    style="yellow",
                ),
                soft_wrap=True,
            )
    if slow.phases:
        console.print(
            Text(f"Time by phase and call site (rank {slow.phases[0].rank}, first to last issue)", style="bold")
        )
    for p in slow.phases:
        site = "?" if p.call_site is None else p.call_site.rsplit("/", 1)[-1]
        console.print(
            Text(
                f"  {phase_label(p.phase)} {p.op} {site}: {p.count:,} in {p.seconds:.2f} s, {megabytes(p.bytes)}, "
                f"{p.mean_interval_s * 1e3:.2f} ms apart"
            ),
            soft_wrap=True,
        )


def alignment_table(report: Report) -> Table:
    div = report.divergence
    title = f"Group {div.group.label()}, {_ranks(div.group.ranks)}: collectives around " + (
        f"p2p #{div.seq}" if div.kind == DivergenceKind.P2P else f"#{div.seq}"
    )
    table = Table(
        title=escape(title), title_justify="left", box=box.SIMPLE_HEAD, show_lines=False, pad_edge=False, expand=False
    )
    table.add_column("seq", justify="right", no_wrap=True)
    for r in report.alignment_ranks:
        mark = " (culprit)" if r in report.culprit_ranks else ""
        table.add_column(f"rank {r}{mark}", overflow="fold", min_width=22)
    for row in report.alignment:
        at = row.seq == div.seq
        seq = Text(f"▶ {row.seq}" if at else str(row.seq), style="bold" if at else "dim")
        table.add_row(seq, *(_cell(row, r, at) for r in report.alignment_ranks))
    return table


def _cell(row: AlignedRow, rank: int, at_divergence: bool) -> Text:
    op = row.cells.get(rank)
    diverging = rank in row.diverging
    style = "bold red" if diverging else ("" if at_divergence else "dim")
    if op is None:
        return Text("— never issued" if diverging else "", style=style)
    text = Text(f"{op.op} {_shapes(op)} {'/'.join(_DTYPES.get(d, d) for d in op.dtypes)}".rstrip(), style=style)
    if op.reduce_op:
        text.append(f" {op.reduce_op}", style=style)
    detail = f"\n{phase_label(op.phase)} s{op.step}"
    if op.short_site:
        detail += f" · {op.short_site}"
    text.append(detail, style="red" if diverging else "dim")
    if op.module:
        text.append(f"\nunit {op.module}", style="dim")
    if not op.completed:
        text.append(
            "\nwaiting (not completed)" if at_divergence else "\nnot seen completing",
            style="yellow" if at_divergence else "dim",
        )
    return text


def _shapes(op: OpView) -> str:
    text = ",".join("[" + ",".join(map(str, s)) + "]" for s in op.shapes[:3])
    if len(op.shapes) > 3:
        text += f",+{len(op.shapes) - 3}"
    return text or "[]"


def _fix(report: Report, console: Console) -> None:
    if report.fixes:
        line = Text("Fix: ", style="bold").append(", ".join(report.fixes), style="bold green")
        console.print(line)
    if report.verify_command:
        console.print(Text("  prove it: ", style="bold").append(report.verify_command, style="bold"), soft_wrap=True)
    elif report.fix_note:
        console.print(Text("  ").append(report.fix_note, style="yellow"), soft_wrap=True)
    s = report.suggestion
    if s is None:
        return
    parts = []
    if s.call_site:
        where = s.call_site.rsplit("/", 1)[-1] + (f" in {s.function}" if s.function else "")
        parts.append(Text(f"At {where}:", style="bold"))
        if s.source_line:
            line_no = s.call_site.rsplit(":", 1)[-1]
            parts.append(Text(f"  {line_no} │ {s.source_line}", style="cyan"))
    parts.append(Text(s.text))
    console.print(Panel(Group(*parts), title="Suggestion", title_align="left", border_style="blue", expand=True))


def _incomplete(report: Report, console: Console) -> None:
    if not report.incomplete:
        return
    console.print(Text("Incomplete data", style="bold yellow"))
    for line in report.incomplete[:20]:
        console.print(Text("  • " + line, style="yellow"), soft_wrap=True)
    if len(report.incomplete) > 20:
        console.print(Text(f"  ... {len(report.incomplete) - 20} more (see --json)", style="yellow"))


def _ranks(ranks) -> str:
    return rank_names(ranks, ranges=True)
