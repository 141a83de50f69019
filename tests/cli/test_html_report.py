"""The HTML report (``moedoctor analyze --html``) opened in a real headless Chromium: a lane per rank
in each diverged group, the mismatch highlighted, the wait-for graph drawn, the stacks folded, the fix
and its verify command, the Perfetto link, no JavaScript error, nothing fetched from the network."""

from __future__ import annotations

import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from html_browser import GOLDEN, dump_dom, report, screenshot  # noqa: E402


class Dom(HTMLParser):
    """Every element's tag, attributes and class set, in document order."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.title = ""
        self._in_title = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        self._in_title = tag == "title"

    def handle_data(self, data):
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        self._in_title = False

    def find(self, tag: str | None = None, cls: str | None = None, **attrs) -> list[dict[str, str]]:
        return [
            a for t, a in self.elements
            if (tag is None or t == tag) and (cls is None or cls in a.get("class", "").split())
            and all(a.get(k.replace("_", "-")) == str(v) for k, v in attrs.items())
        ]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("html")
    return {name: report(name, folder) for name in ("inflight_metric_allreduce", "collective_order_inversion")}


def _expected(name: str) -> dict:
    return json.loads((GOLDEN / name / "expected_report.json").read_text())


@pytest.mark.parametrize("name", ["inflight_metric_allreduce", "collective_order_inversion"])
def test_html_report_in_chromium(name, pages):
    html, trace = pages[name]
    want = _expected(name)
    text = html.read_text(encoding="utf-8")
    # self-contained: no remote script, style, image or font (the SVG namespace is a name, not a fetch)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "the page fetches from the network"
    assert "@import" not in text and "url(http" not in text
    dom_text = dump_dom(html)
    dom = Dom(dom_text)
    root = dom.find("html")[0]
    assert root.get("data-js-errors", "") == "", root["data-js-errors"]
    assert dom.find("body", data_ready="1"), "the page's script did not run to its end"
    assert dom.title.startswith(f"moedoctor: {want['verdict'].upper()}")
    div = want["divergence"]
    group, seq = div["group"]["name"], div["seq"]
    section = [s for s in dom.find("section", cls="group") if s["data-group"] == group]
    assert section and section[0]["data-seq"] == str(seq)
    # a lane per rank: its label and a cell at the divergence, in every diverged group drawn
    for rank in div["group"]["ranks"]:
        assert dom.find("div", cls="lane-label", data_rank=rank)
        assert dom.find("div", cls="op", data_rank=rank, data_seq=seq)
    # the divergence highlighted: the culprit's cell at the divergence, and nothing before it
    culprit = want["culprit_ranks"][0]
    marked = dom.find("div", cls="mismatch")
    assert any(c["data-rank"] == str(culprit) and c["data-seq"] == str(seq) for c in marked), marked
    assert all(int(c["data-seq"]) >= seq for c in marked)
    assert dom.find("div", cls="culprit", data_rank=culprit)
    # each rank's stack, folded
    stacks = dom.find("details", cls="stack")
    assert sorted(int(s["data-rank"]) for s in stacks) == div["group"]["ranks"]
    assert all("open" not in s for s in stacks)
    # the Perfetto trace, linked relative to the page
    link = dom.find("a", id="perfetto")
    assert link and (html.parent / link[0]["href"]).resolve() == trace.resolve() and trace.is_file()
    if want["fixes"]:
        assert f"moedoctor verify --fix {want['fixes'][0]} --run {name}" in dom_text
        assert dom.find("button", data_copy="verify-command")
    assert dom.find("h2", id="coverage")
    png = screenshot(html, html.with_suffix(".png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < png.stat().st_size < 2_000_000


def test_wait_for_cycle_drawn(pages):
    html, _ = pages["collective_order_inversion"]
    dom = Dom(dump_dom(html))
    assert dom.find("svg", id="wait-for")
    edges = {(e["data-from"], e["data-to"]) for e in dom.find("path", cls="cycle")}
    assert edges == {("0", "1"), ("1", "0")}
    assert {n["data-rank"] for n in dom.find("g", cls="node")} == {"0", "1"}


def test_evidence_and_candidates_wrap(pages):
    html, _ = pages["inflight_metric_allreduce"]
    text = html.read_text(encoding="utf-8")
    assert "overflow-wrap:anywhere" in text
    dom = Dom(dump_dom(html))
    assert dom.find("ul", id="evidence") and dom.find("table", id="candidates")
    assert "outside forward/backward" in text and ", other" not in text.split("<h2>Collectives")[1].split("<h2>Evidence")[0]
