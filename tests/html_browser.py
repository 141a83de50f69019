"""Open moedoctor's HTML report in headless Chromium (Debian's ``chromium``, installed by README's
test command): the DOM after the page's scripts ran, with any JavaScript error collected into it, and
a screenshot.

    python tests/html_browser.py    # rewrite docs/html-*.png from the golden corpus

writes ``docs/html-inflight_metric_allreduce.png`` and ``docs/html-collective_order_inversion.png``
(``moedoctor analyze tests/golden/NAME --html ... --perfetto ...``, then ``chromium --headless
--screenshot``); ``tests/cli/test_html_report.py`` asserts on the same pages.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
DOCS = REPO / "docs"
CASES = ("inflight_metric_allreduce", "collective_order_inversion")
#: Collects every uncaught error and console.error of the page into ``<html data-js-errors>``.
ERROR_COLLECTOR = (
    "<script>(function(){var h=document.documentElement;h.setAttribute('data-js-collector','on');function note(m){"
    "h.setAttribute('data-js-errors',(h.getAttribute('data-js-errors')||'')+String(m)+' | ');}"
    "window.addEventListener('error',function(e){note(e.message||'error');});"
    "window.addEventListener('unhandledrejection',function(e){note('rejection: '+e.reason);});"
    "var ce=console.error;console.error=function(){note(Array.prototype.join.call(arguments,' '));"
    "return ce.apply(console,arguments);};})();</script>"
)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no chromium on PATH: README's test command installs it (apt-get install -y chromium)")


def _browser(args: list[str], page: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={page.parent / '.chromium-profile'}", *args, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "LANG": "C.UTF-8"})


def dump_dom(page: Path) -> str:
    """The DOM after the page's scripts ran, the page's errors in ``<html data-js-errors=...>`` (and
    ``data-js-collector="on"``: the collector itself ran)."""
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(re.sub(r"<head>", "<head>" + ERROR_COLLECTOR, page.read_text(encoding="utf-8"), count=1),
                     encoding="utf-8")
    done = _browser(["--dump-dom", "--virtual-time-budget=2000"], probe)
    assert done.returncode == 0 and 'data-js-collector="on"' in done.stdout, done.stderr[-2000:]
    return done.stdout


def screenshot(page: Path, png: Path, width: int = 1100, height: int = 1300) -> Path:
    done = _browser([f"--screenshot={png}", f"--window-size={width},{height}"], page)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    return png


def report(name: str, folder: Path) -> tuple[Path, Path]:
    """``moedoctor analyze`` of golden case NAME (copied into FOLDER): the HTML page and the Perfetto trace."""
    run = folder / name
    if not run.exists():
        shutil.copytree(GOLDEN / name, run)
    html, trace = folder / f"{name}.html", folder / f"{name}.perfetto.json"
    done = subprocess.run([sys.executable, "-m", "moedoctor", "analyze", name, "--html", html.name, "--perfetto",
                           trace.name], cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and html.is_file(), done.stdout[-2000:] + done.stderr[-2000:]
    return html, trace


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            html, _ = report(name, Path(tmp))
            png = screenshot(html, DOCS / f"html-{name}.png")
            print(f"{png.relative_to(REPO)}: {png.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
