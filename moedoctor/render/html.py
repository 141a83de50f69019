"""The terminal report as a self-contained HTML page (inline styles, no external resources)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from moedoctor.analysis.model import Report
from moedoctor.render.terminal import render_report


def html_page(report: Report, width: int = 140) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    render_report(report, console)
    return console.export_html(inline_styles=True, clear=True)


def write_html(report: Report, path: Path) -> Path:
    path = Path(path)
    path.write_text(html_page(report), encoding="utf-8")
    return path
