"""Off a terminal, every command prints at one sensible width (``moedoctor/render/width.py``): the
help is not cut at 80 columns and keeps ``<rdzv id>``, a one-line notice never wraps mid-phrase, and
the verify table is as wide as the rest; ``$COLUMNS`` is honoured; on a terminal its own width."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from rich.table import Table

from moedoctor.cli.common import pick_recorder
from moedoctor.render.width import DEFAULT_WIDTH, console, screen_width

REPO = Path(__file__).resolve().parents[2]


def _moedoctor(*args: str, columns: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH", "LINES")}
    env["PYTHONPATH"] = str(REPO)
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run([sys.executable, "-m", "moedoctor", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)


def test_run_help_off_a_terminal_is_whole():
    done = _moedoctor("run", "--help")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) == DEFAULT_WIDTH
    assert "…" not in done.stdout  # no option name or help word cut
    assert "--check-params-step" in done.stdout and "MOEDOCTOR_MAX_EVENTS" in done.stdout
    assert "moedoctor/<rdzv id>/" in done.stdout


def test_columns_is_honoured_off_a_terminal():
    done = _moedoctor("analyze", "--help", columns="100")
    assert done.returncode == 0 and max(len(line) for line in done.stdout.splitlines()) == 100


def test_the_width_off_and_on_a_terminal(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert screen_width(io.StringIO()) == DEFAULT_WIDTH
    monkeypatch.setenv("COLUMNS", "132")
    assert screen_width(io.StringIO()) == 132
    monkeypatch.setenv("COLUMNS", "not a number")
    assert screen_width(io.StringIO()) == DEFAULT_WIDTH

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert screen_width(Tty()) is None  # rich measures the terminal


def test_a_build_notice_is_one_line_and_the_verify_table_as_wide_as_the_rest(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    screen = console(stderr=True)
    notice = "building the native recorder for this environment (first run, ~40 s)..."
    monkeypatch.setattr("moedoctor.cli.common.choose_recorder", lambda wanted, say: say(notice) or "choice")
    pick_recorder("native", screen)
    assert out.getvalue() == f"moedoctor: {notice}\n"
    # the verify table (render_verification's console) and the report print at one width
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    table = Table("a", "b")
    table.add_row("x" * 200, "y")
    wide = console()
    wide.print(table)
    assert wide.width == DEFAULT_WIDTH == max(len(line) for line in sys.stdout.getvalue().splitlines())


def test_every_command_prints_through_the_one_width():
    """No command makes a rich Console of its own width (verify's table was 140 columns, the rest 80)."""
    own = [f"{p.name}:{i}" for p in sorted((REPO / "moedoctor" / "cli").glob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if "Console(" in line]
    assert own == []
    assert "def console(" in (REPO / "moedoctor" / "render" / "width.py").read_text()
