"""The report as a self-contained HTML page: inline CSS, JS and SVG, nothing fetched from the network.

What it shows, from the ``Report`` (and, where given, the run's traces and stacks): the verdict; per
process group that diverged, the ranks' collectives around the divergence as lanes, one per rank,
with the mismatching cells highlighted; the wait-for graph (SVG); each rank's stack at the hang,
folded; the evidence and every candidate pattern with its evidence; the fix and the exact verify
command; the "Slow, not stuck", "Busy, not stuck" and parameter-check sections when present; the
coverage; a link to the Perfetto trace. ``docs/report-format.md`` shows it and the screenshot command.
"""

from __future__ import annotations

import math
import os
from html import escape
from pathlib import Path
from urllib.parse import quote

from moedoctor.analysis.loading.run_data import RunData
from moedoctor.analysis.model import Divergence, DivergenceKind, OpView, Report, Verdict, WaitEdge
from moedoctor.analysis.evidence.timing import megabytes
from moedoctor.run_records import Frame, is_library_frame
from moedoctor.wording import phase_label, rank_names

#: Collectives shown before and after the divergence in each group's lanes.
BEFORE, AFTER = 5, 1
#: Lanes (ranks) drawn per group; beyond, the ranks of the diverging classes first, then the lowest.
MAX_LANES = 16
#: Nodes drawn in the wait-for graph.
MAX_NODES = 32
#: Frames shown per stack.
MAX_FRAMES = 60

_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64", "int32": "i32"}
_COLORS = {
    Verdict.HEALTHY: "#1a7f37",
    Verdict.DESYNC: "#cf222e",
    Verdict.STUCK: "#9a6700",
    Verdict.CRASHED: "#cf222e",
    Verdict.SLOW: "#9a6700",
    Verdict.INTERRUPTED: "#9a6700",
}

_CSS = """
:root{--fg:#1f2328;--mut:#656d76;--line:#d0d7de;--bg:#f6f8fa;--bad:#cf222e;
--badbg:#ffebe9;--warn:#9a6700;--warnbg:#fff8c5;--ok:#1a7f37;--acc:#0969da}
*{box-sizing:border-box}
body{margin:0;font:14px/1.5 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:var(--fg);background:#fff}
main{max-width:1200px;margin:0 auto;padding:20px 24px 48px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px;padding-bottom:4px;border-bottom:1px solid var(--line)}
h3{font-size:14px;margin:14px 0 6px}
p,li,td,summary,pre,code{overflow-wrap:anywhere;word-break:break-word}
code,pre,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
pre{white-space:pre-wrap;background:var(--bg);border:1px solid var(--line);
border-radius:6px;padding:8px 10px;margin:6px 0}
.verdict{display:inline-block;color:#fff;font-weight:700;
border-radius:6px;padding:2px 10px;margin-right:8px;letter-spacing:.04em}
.summary{font-size:15px;margin:10px 0}
.kv{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
.kv dt{color:var(--mut)}
.kv dd{margin:0}
.ok{color:var(--ok)}
.mut{color:var(--mut)}
.bad{color:var(--bad)}
.warn{color:var(--warn)}
.lanes{display:grid;gap:4px;overflow-x:auto;padding-bottom:6px}
.lane-label{font-weight:600;align-self:center;white-space:nowrap;padding-right:6px}
.lane-label.culprit{color:var(--bad)}
.seqh{font-size:12px;color:var(--mut);text-align:center}
.seqh.at{color:var(--bad);font-weight:700}
.op{border:1px solid var(--line);border-radius:6px;padding:4px 6px;background:var(--bg);font-size:12px;min-width:0}
.op .name{font-weight:600;font-family:ui-monospace,Menlo,Consolas,monospace}
.op .det{color:var(--mut)}
.op.at{border-color:#8c959f;background:#fff}
.op.mismatch{border:2px solid var(--bad);background:var(--badbg)}
.op.mismatch .det{color:#82071e}
.op.empty{background:transparent;border-style:dashed;color:var(--mut)}
.op.never{border:2px dashed var(--bad);background:var(--badbg);color:var(--bad);font-weight:600}
.wait{color:var(--warn);font-weight:600}
.frames .lib{color:var(--mut)}
.card{border:1px solid var(--line);border-radius:8px;padding:10px 14px;margin:10px 0}
.fix{border-color:#4ac26b;background:#f0fff4}
.cmd{display:flex;gap:8px;align-items:flex-start}
.cmd pre{flex:1;margin:0;background:#fff}
button{font:inherit;font-size:12px;border:1px solid var(--line);
background:#fff;border-radius:6px;padding:3px 10px;cursor:pointer}
details{border:1px solid var(--line);border-radius:6px;margin:6px 0;padding:4px 10px}
details>summary{cursor:pointer}
td:first-child,td.nw{white-space:nowrap}
td ul{margin:0;padding-left:18px}
table{border-collapse:collapse;margin:6px 0}
td,th{border-bottom:1px solid var(--line);padding:3px 10px 3px 0;text-align:left;vertical-align:top}
.score{display:inline-block;height:8px;background:var(--acc);border-radius:4px;vertical-align:middle}
svg text{font:12px -apple-system,"Segoe UI",Helvetica,Arial,sans-serif}
footer{margin-top:32px;color:var(--mut);font-size:12px}
"""

_JS = """
(function(){
  document.querySelectorAll('button[data-copy]').forEach(function(b){
    b.addEventListener('click',function(){
      var t=document.getElementById(b.getAttribute('data-copy')).textContent;
      function done(){b.textContent='copied';setTimeout(function(){b.textContent='copy';},1500);}
      if(navigator.clipboard){navigator.clipboard.writeText(t).then(done,function(){});}
    });
  });
  var all=document.getElementById('stacks-toggle');
  if(all){all.addEventListener('click',function(){
    var ds=document.querySelectorAll('#stacks details.stack');var open=!ds[0]||!ds[0].open;
    ds.forEach(function(d){d.open=open;});all.textContent=open?'fold all':'unfold all';
  });}
  document.body.setAttribute('data-ready','1');
})();
"""


def html_page(
    report: Report, run: RunData | None = None, perfetto: str | None = None, params: dict | None = None
) -> str:
    """The page. ``run``: the analyzed run (each group's lanes from its traces, the stacks' frames);
    ``perfetto``: the Perfetto trace's address relative to the page; ``params``: the parameter check
    (``ParamsCheck.to_json()``) of a run recorded with ``--check-params``."""
    color = _COLORS[report.verdict]
    title = f"moedoctor: {report.verdict.value.upper()}" + (f", {report.pattern_title}" if report.pattern_title else "")
    body = [
        "<header>",
        f'<h1><span class="verdict" style="background:{color}">{escape(report.verdict.value.upper())}</span>'
        f"{escape(report.pattern_title or _no_pattern(report))}</h1>",
        f'<p class="summary">{escape(report.summary)}</p>',
        '<dl class="kv">',
    ]
    if report.pattern:
        body.append(f"<dt>Pattern</dt><dd><code>{escape(report.pattern)}</code></dd>")
    if report.verdict != Verdict.HEALTHY:
        culprit = rank_names(report.culprit_ranks, ranges=True) if report.culprit_ranks else "none"
        body.append(f'<dt>Culprit</dt><dd><b class="bad">{escape(culprit)}</b>')
        if report.culprit_reasoning:
            body.append(f' <span class="mut">{escape(report.culprit_reasoning)}</span>')
        body.append("</dd>")
    body.append(f"<dt>Source</dt><dd><code>{escape(report.source)}</code> ({escape(report.source_kind)})</dd>")
    if perfetto:
        body.append(
            f'<dt>Timeline</dt><dd><a id="perfetto" href="{escape(perfetto)}">Perfetto trace</a> '
            '<span class="mut">(one track per rank and group, the divergence marked: open it at '
            "ui.perfetto.dev, Open trace file)</span></dd>"
        )
    body += ["</dl>", "</header>"]
    body += _lanes_section(report, run)
    body += _wait_for_section(report)
    body += _evidence_section(report)
    body += _fix_section(report)
    body += _slow_section(report)
    body += _busy_section(report)
    body += _params_section(params)
    body += _stacks_section(report, run)
    body += _coverage_section(report)
    body.append(f"<footer>moedoctor report, schema {report.schema_version}</footer>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head>\n"
        f"<body><main>\n{chr(10).join(body)}\n</main><script>{_JS}</script></body></html>\n"
    )


def _no_pattern(report: Report) -> str:
    return "no problem found" if report.verdict == Verdict.HEALTHY else "no known pattern"


def write_html(
    report: Report, path: Path, run: RunData | None = None, perfetto: Path | None = None, params: dict | None = None
) -> Path:
    """Write the page; ``perfetto``, the trace written beside it, is linked relative to the page."""
    path = Path(path)
    link = None
    if perfetto is not None:
        link = quote(os.path.relpath(Path(perfetto).resolve(), path.resolve().parent).replace(os.sep, "/"))
    path.write_text(html_page(report, run, link, params), encoding="utf-8")
    return path


# ---- lanes ---------------------------------------------------------------------------------------


def _lanes_section(report: Report, run: RunData | None) -> list[str]:
    groups = _diverged_groups(report)
    if not groups:
        return []
    out = ["<h2>Collectives around the divergence</h2>"]
    out.append(
        '<p class="mut">One lane per rank, in issue order on each group; the highlighted cells differ '
        "from the other ranks' (or were never issued).</p>"
    )
    for div in groups[:8]:
        out += _group_lanes(report, div, run)
    if len(groups) > 8:
        out.append(f'<p class="mut">... {len(groups) - 8} more groups (see --json)</p>')
    return out


def _diverged_groups(report: Report) -> list[Divergence]:
    """The primary divergence first, then the other groups' (deduplicated)."""
    out: list[Divergence] = []
    seen: set[tuple[str, int]] = set()
    for d in ([report.divergence] if report.divergence else []) + list(report.groups):
        if (d.group.name, d.seq) not in seen:
            seen.add((d.group.name, d.seq))
            out.append(d)
    return out


def _group_lanes(report: Report, div: Divergence, run: RunData | None) -> list[str]:
    primary = report.divergence is not None and div is report.divergence
    mismatched = _mismatched(div)
    ranks = _lane_ranks(div, mismatched, report.culprit_ranks)
    seqs, cells = _cells(report, div, run, ranks, primary)
    at = "p2p #" if div.kind == DivergenceKind.P2P else "#"
    label = div.group.label()
    out = [
        f'<section class="group" data-group="{escape(div.group.name)}" data-seq="{div.seq}">',
        f"<h3>Group {escape(label)}, {escape(rank_names(div.group.ranks, ranges=True))}: "
        f"{escape(div.kind.value)} at {at}{div.seq}{' (the divergence)' if primary else ''}</h3>",
        f'<div class="lanes" style="grid-template-columns:max-content repeat({len(seqs)},minmax(9.5em,12.5em))">',
        "<div></div>",
    ]
    for s in seqs:
        out.append(f'<div class="seqh{" at" if s == div.seq else ""}">{"▶ " if s == div.seq else ""}#{s}</div>')
    for r in ranks:
        culprit = r in report.culprit_ranks
        out.append(
            f'<div class="lane-label{" culprit" if culprit else ""}" data-rank="{r}">rank {r}'
            f"{' (culprit)' if culprit else ''}</div>"
        )
        for s in seqs:
            out.append(_cell(cells.get(r, {}).get(s), r, s, s == div.seq, r in mismatched and s == div.seq))
    out.append("</div>")
    if len(div.group.ranks) > len(ranks):
        out.append(f'<p class="mut">{len(div.group.ranks) - len(ranks)} more ranks of this group not drawn.</p>')
    if div.breaches:
        out.append("<ul>" + "".join(f"<li>{escape(b)}</li>" for b in div.breaches[:8]) + "</ul>")
    out.append("</section>")
    return out


def _mismatched(div: Divergence) -> set[int]:
    """The ranks whose collective at the divergence differs: those outside the largest class (all of
    them when classes tie), and those that never issued it."""
    classes = [tuple(c) for c in div.classes if c]
    missing = set(div.missing) | {r for r, op in div.per_rank.items() if op is None}
    if div.kind == DivergenceKind.P2P and div.peers:
        return set(div.peers)
    if len(classes) < 2:
        return missing or set(div.per_rank)
    top = max(len(c) for c in classes)
    tied = sum(1 for c in classes if len(c) == top) > 1
    out = {r for c in classes if tied or len(c) < top for r in c}
    return out | missing


def _lane_ranks(div: Divergence, mismatched: set[int], culprits: list[int]) -> list[int]:
    ranks = list(div.group.ranks) or sorted(div.per_rank)
    if len(ranks) <= MAX_LANES:
        return ranks
    first = [r for r in ranks if r in mismatched or r in culprits]
    rest = [r for r in ranks if r not in first]
    return sorted((first + rest)[:MAX_LANES])


def _cells(
    report: Report, div: Divergence, run: RunData | None, ranks: list[int], primary: bool
) -> tuple[list[int], dict[int, dict[int, OpView | None]]]:
    lo, hi = max(1, div.seq - BEFORE), div.seq + AFTER
    cells: dict[int, dict[int, OpView | None]] = {r: {} for r in ranks}
    if run is not None and div.kind != DivergenceKind.P2P:
        wanted = set(ranks)
        for trace in run.traces:
            if trace.rank not in wanted:
                continue
            for e in trace.events:
                if e.group.name == div.group.name and not e.is_p2p and lo <= e.seq <= hi:
                    cells[trace.rank].setdefault(e.seq, OpView.of(e))
    elif primary and report.alignment:
        for row in report.alignment:
            for r, op in row.cells.items():
                if r in cells:
                    cells[r][row.seq] = op
    for r, op in div.per_rank.items():
        if r in cells and op is not None:
            cells[r].setdefault(div.seq, op)
    seqs = sorted({s for c in cells.values() for s in c} | {div.seq})
    return [s for s in seqs if s <= div.seq + AFTER], cells


def _cell(op: OpView | None, rank: int, seq: int, at: bool, mismatch: bool) -> str:
    attrs = f'data-rank="{rank}" data-seq="{seq}"'
    if op is None:
        if mismatch:
            return f'<div class="op never mismatch" {attrs}>never issued</div>'
        return f'<div class="op empty" {attrs}></div>'
    cls = "op" + (" at" if at else "") + (" mismatch" if mismatch else "")
    shapes = ",".join("[" + ",".join(map(str, s)) + "]" for s in op.shapes[:3]) or "[]"
    if len(op.shapes) > 3:
        shapes += f",+{len(op.shapes) - 3}"
    dtypes = "/".join(_DTYPES.get(d, d) for d in op.dtypes[:3])
    lines = [f'<div class="name">{escape(op.op)}</div>', f"<div>{escape(shapes)} {escape(dtypes)}"]
    if op.reduce_op:
        lines[-1] += f" {escape(op.reduce_op)}"
    lines[-1] += "</div>"
    lines.append(f'<div class="det">{escape(phase_label(op.phase))}, step {op.step}</div>')
    if op.short_site:
        lines.append(f'<div class="det mono" title="{escape(op.call_site or "")}">{escape(op.short_site)}</div>')
    if op.module:
        lines.append(f'<div class="det">unit {escape(op.module)}</div>')
    if not op.completed:
        waiting = '<div class="wait">waiting (not completed)</div>'
        lines.append(waiting if at else '<div class="det">not seen completing</div>')
    return f'<div class="{cls}" {attrs}>{"".join(lines)}</div>'


# ---- wait-for graph ------------------------------------------------------------------------------


def _wait_for_section(report: Report) -> list[str]:
    edges = report.cycle or report.wait_for
    if not edges:
        return []
    head = "Wait-for graph" + (" (a cycle)" if report.cycle else "")
    out = [f"<h2>{head}</h2>", _wait_for_svg(report.wait_for, report.cycle or [], report.culprit_ranks)]
    out.append("<ul>")
    for e in edges[:16]:
        out.append(
            f"<li>rank {e.rank} waits in <code>{escape(e.op)}</code> #{e.seq} of group {escape(e.group)} "
            f"for {escape(rank_names(e.waits_for, ranges=True))}</li>"
        )
    out.append("</ul>")
    if len(edges) > 16:
        out.append(f'<p class="mut">... {len(edges) - 16} more edges (see --json)</p>')
    return out


def _wait_for_svg(edges: list[WaitEdge], cycle: list[WaitEdge], culprits: list[int]) -> str:
    nodes: list[int] = []
    for e in list(cycle) + list(edges):
        for r in (e.rank, *e.waits_for):
            if r not in nodes:
                nodes.append(r)
    drawn = sorted(nodes[:MAX_NODES])
    n = len(drawn)
    pos: dict[int, tuple[float, float]]
    if n <= 2:  # side by side
        width, height = 460, 170
        pos = {r: (90.0 + i * (width - 180), height / 2) for i, r in enumerate(drawn)}
    else:  # on a circle, the first on the left
        width = height = 380 if n <= 8 else 560
        c, radius = width / 2, width / 2 - 70
        angles = {r: math.pi + 2 * math.pi * i / n for i, r in enumerate(drawn)}
        pos = {r: (c + radius * math.cos(a), c + radius * math.sin(a)) for r, a in angles.items()}
    in_cycle = {(e.rank, w) for e in cycle for w in e.waits_for}
    parts = [
        f'<svg id="wait-for" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="wait-for graph">',
        '<defs><marker id="arr" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="#57606a"/></marker>'
        '<marker id="arr-c" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="#cf222e"/></marker></defs>',
    ]
    node_r = 24
    seen: set[tuple[int, int]] = set()
    for e in list(cycle) + list(edges):
        for w in e.waits_for:
            if (e.rank, w) in seen or e.rank not in pos or w not in pos or e.rank == w:
                continue
            seen.add((e.rank, w))
            (x1, y1), (x2, y2) = pos[e.rank], pos[w]
            dx, dy = x2 - x1, y2 - y1
            d = math.hypot(dx, dy) or 1.0
            # a curve, so that a and b waiting on each other draw two arrows
            nx, ny = -dy / d, dx / d
            mx, my = (x1 + x2) / 2 + nx * 44, (y1 + y2) / 2 + ny * 44
            sx, sy = _towards(x1, y1, mx, my, node_r)
            ex, ey = _towards(x2, y2, mx, my, node_r + 2)
            red = (e.rank, w) in in_cycle
            parts.append(
                f'<path class="edge{" cycle" if red else ""}" data-from="{e.rank}" data-to="{w}" '
                f'd="M{sx:.1f},{sy:.1f} Q{mx:.1f},{my:.1f} {ex:.1f},{ey:.1f}" fill="none" '
                f'stroke="{"#cf222e" if red else "#57606a"}" stroke-width="{2.2 if red else 1.4}" '
                f'marker-end="url(#{"arr-c" if red else "arr"})"/>'
            )
            lx, ly = (sx + 2 * mx + ex) / 4 + nx * 14, (sy + 2 * my + ey) / 4 + ny * 14 + 4
            parts.append(
                f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="middle" fill="#57606a" '
                f'paint-order="stroke" stroke="#fff" stroke-width="3">'
                f"{escape(e.op)} #{e.seq}, group {escape(e.group)}</text>"
            )
    for r, (x, y) in pos.items():
        culprit = r in culprits
        parts.append(
            f'<g class="node" data-rank="{r}"><circle cx="{x:.1f}" cy="{y:.1f}" r="{node_r}" '
            f'fill="{"#ffebe9" if culprit else "#f6f8fa"}" stroke="{"#cf222e" if culprit else "#57606a"}" '
            f'stroke-width="{2 if culprit else 1.2}"/><text x="{x:.1f}" y="{y + 4:.1f}" text-anchor="middle" '
            f'font-weight="600">rank {r}</text></g>'
        )
    parts.append("</svg>")
    if len(nodes) > MAX_NODES:
        parts.append(f'<p class="mut">{len(nodes) - MAX_NODES} more ranks not drawn.</p>')
    return "".join(parts)


def _towards(x: float, y: float, tx: float, ty: float, by: float) -> tuple[float, float]:
    d = math.hypot(tx - x, ty - y) or 1.0
    return x + (tx - x) / d * by, y + (ty - y) / d * by


# ---- evidence, fix, sections ---------------------------------------------------------------------


def _evidence_section(report: Report) -> list[str]:
    out: list[str] = []
    if report.evidence:
        out.append('<h2>Evidence</h2><ul id="evidence">')
        out += [f"<li>{escape(line)}</li>" for line in report.evidence]
        out.append("</ul>")
    others = [c for c in report.candidates if c.pattern != report.pattern]
    if others:
        out.append("<h2>Other candidates, and what they lacked</h2>")
        out.append(
            '<p class="mut">The patterns also considered, with their score and the evidence each found: '
            "each lacked the evidence above that made the chosen pattern score higher.</p>"
        )
        out.append('<table id="candidates"><tr><th>pattern</th><th>score</th><th>its evidence</th></tr>')
        for c in others[:12]:
            width = max(2, round(60 * max(0.0, min(1.0, c.score))))
            ev = "".join(f"<li>{escape(e)}</li>" for e in c.evidence[:6]) or "<li class='mut'>none</li>"
            out.append(
                f"<tr><td><code>{escape(c.pattern)}</code></td>"
                f'<td class="nw"><span class="score" style="width:{width}px"></span> {c.score:.2f}</td>'
                f"<td><ul>{ev}</ul></td></tr>"
            )
        out.append("</table>")
    return out


def _fix_section(report: Report) -> list[str]:
    if not (report.fixes or report.verify_command or report.fix_note or report.suggestion):
        return []
    out = [f'<h2>{"Fix" if report.fixes else "Suggestion"}</h2><div class="card fix">']
    if report.fixes:
        out.append("<p><b>Fix:</b> " + ", ".join(f"<code>{escape(f)}</code>" for f in report.fixes) + "</p>")
    if report.verify_command:
        out.append(
            "<p><b>Prove it</b> (reruns the job with the fix injected, no change to your code):</p>"
            f'<div class="cmd"><pre id="verify-command">{escape(report.verify_command)}</pre>'
            '<button data-copy="verify-command">copy</button></div>'
        )
    elif report.fix_note:
        out.append(f'<p class="warn">{escape(report.fix_note)}</p>')
    s = report.suggestion
    if s is not None:
        if s.call_site:
            where = s.call_site.rsplit("/", 1)[-1] + (f" in {s.function}" if s.function else "")
            out.append(f'<p><b>At <span class="mono" title="{escape(s.call_site)}">{escape(where)}</span>:</b></p>')
            if s.source_line:
                out.append(f"<pre>{escape(s.call_site.rsplit(':', 1)[-1])} │ {escape(s.source_line)}</pre>")
        out.append(f"<p>{escape(s.text)}</p>")
    out.append("</div>")
    return out


def _slow_section(report: Report) -> list[str]:
    slow = report.slow
    if slow is None:
        return []
    out = ['<h2 id="slow">Slow, not stuck (broadcast-storm)</h2><ul>']
    for s in slow.storms[:8]:
        out.append(
            f'<li>{escape(s.line())} ({escape(rank_names(s.ranks, ranges=True))})<br><span class="mut">coalescing: '
            f"about {s.gain.coalesced_s:.2f} s instead of {s.seconds:.1f} s (saves {s.gain.gain_s:.1f} s); "
            f"{escape(s.gain.method)}</span>"
            + (f'<br><span class="warn">weak estimate: {escape(s.gain.weak)}</span>' if s.gain.weak else "")
            + "</li>"
        )
    out.append("</ul>")
    if slow.phases:
        out.append(f"<h3>Time by phase and call site (rank {slow.phases[0].rank}, first to last issue)</h3>")
        out.append("<table><tr><th>phase</th><th>op</th><th>call site</th><th>count</th><th>time</th><th>bytes</th>")
        out.append("<th>apart</th></tr>")
        for p in slow.phases:
            site = "?" if p.call_site is None else p.call_site.rsplit("/", 1)[-1]
            out.append(
                f"<tr><td>{escape(phase_label(p.phase))}</td><td><code>{escape(p.op)}</code></td>"
                f'<td class="mono">{escape(site)}</td><td>{p.count:,}</td><td>{p.seconds:.2f} s</td>'
                f"<td>{escape(megabytes(p.bytes))}</td><td>{p.mean_interval_s * 1e3:.2f} ms</td></tr>"
            )
        out.append("</table>")
    return out


def _busy_section(report: Report) -> list[str]:
    if not report.busy:
        return []
    out = ['<h2 id="busy">Busy, not stuck <span class="mut">(the job was not stopped for these)</span></h2><ul>']
    for b in report.busy[:16]:
        state = "" if b.ended else " (still so when the run ended)"
        out.append(f"<li>{b.seconds:.0f} s without a collective{state}: {escape(b.line)}</li>")
    out.append("</ul>")
    if len(report.busy) > 16:
        out.append(f'<p class="mut">... {len(report.busy) - 16} more (see --json)</p>')
    return out


def _params_section(params: dict | None) -> list[str]:
    if not params:
        return []
    findings = params.get("findings") or []
    out = ['<h2 id="params">Parameter check</h2>']
    out.append(
        f"<p>ranks {escape(rank_names(params.get('ranks') or [], ranges=True))}, points "
        f"{escape(', '.join(map(str, params.get('points') or [])))}: "
        + (f'<b class="bad">{len(findings)} inconsistent</b>' if findings else '<b class="ok">consistent</b>')
        + "</p>"
    )
    if findings:
        out.append("<ul>")
        for f in findings[:20]:
            out.append(
                f"<li><code>{escape(str(f.get('name')))}</code> at {escape(str(f.get('point')))} "
                f"({escape(str(f.get('kind')))}): {escape(str(f.get('evidence')))}</li>"
            )
        out.append("</ul>")
    for note in (params.get("notes") or [])[:10]:
        out.append(f'<p class="mut">{escape(str(note))}</p>')
    return out


def _stacks_section(report: Report, run: RunData | None) -> list[str]:
    stacks = run.stacks if run is not None else {}
    ranks = sorted({r.rank for r in report.ranks} | set(stacks))
    if not ranks:
        return []
    by_rank = {r.rank: r for r in report.ranks}
    out = ['<h2>Each rank at the hang <button id="stacks-toggle">unfold all</button></h2><div id="stacks">']
    for r in ranks[:64]:
        summary = by_rank.get(r)
        dump = stacks.get(r)
        line = f"rank {r}"
        if r in report.culprit_ranks:
            line += " (culprit)"
        if summary is not None:
            if summary.last is not None:
                line += f": last {summary.last.op} #{summary.last.seq} of group {summary.group}"
                line += ", waiting" if summary.waiting else ", completed"
            if summary.stack:
                line += f"; in {summary.stack}"
            if summary.exit_code is not None:
                line += f"; exited {summary.exit_code}"
            elif summary.exit_source:
                line += f"; {summary.exit_source}"
        body: list[str] = []
        if dump is not None and dump.main_thread:
            frames = dump.main_thread[:MAX_FRAMES]
            more = len(dump.main_thread) - MAX_FRAMES
            body.append(
                '<p class="mut">main thread, innermost first; the job\'s own frames in bold</p><pre class="frames">'
                + "\n".join(_frame(f) for f in frames)
                + (f"\n... {more} more" if more > 0 else "")
                + "</pre>"
            )
            others = {k: v for k, v in dump.threads.items() if v and v != dump.main_thread}
            for name, tframes in list(others.items())[:8]:
                body.append(
                    f'<details><summary class="mut">thread {escape(str(name))}</summary><pre>'
                    + "\n".join(_frame(f) for f in tframes[:MAX_FRAMES])
                    + "</pre></details>"
                )
        elif dump is not None and dump.error:
            body.append(f'<p class="warn">no stack: {escape(dump.error)}</p>')
        else:
            body.append('<p class="mut">no stack recorded (innermost frame only, from the report)</p>')
        out.append(f'<details class="stack" data-rank="{r}"><summary>{escape(line)}</summary>{"".join(body)}</details>')
    if len(ranks) > 64:
        out.append(f'<p class="mut">... {len(ranks) - 64} more ranks (see --json)</p>')
    out.append("</div>")
    return out


def _frame(frame: Frame) -> str:
    """One frame: the job's own in bold, the libraries' (torch, the standard library...) dimmed."""
    text = f"{escape(frame.function)}  {escape(frame.file)}:{frame.line}"
    return f'<span class="lib">{text}</span>' if is_library_frame(frame) else f"<b>{text}</b>"


def _coverage_section(report: Report) -> list[str]:
    out = ['<h2 id="coverage">Coverage</h2><dl class="kv">']
    world = "?" if report.world_size is None else str(report.world_size)
    out.append(
        f"<dt>Ranks traced</dt><dd>{len(report.traced_ranks)} of {world} "
        f"({escape(rank_names(report.traced_ranks, ranges=True) if report.traced_ranks else 'none')})</dd>"
    )
    out.append(f"<dt>Collectives</dt><dd>{report.collectives:,}</dd>")
    if report.completion:
        out.append(f"<dt>Completion</dt><dd>{escape(str(report.completion.get('summary', '')))}</dd>")
    out.append("</dl>")
    if report.incomplete:
        out.append('<h3 class="warn">Incomplete data</h3><ul>')
        out += [f'<li class="warn">{escape(line)}</li>' for line in report.incomplete[:50]]
        out.append("</ul>")
        if len(report.incomplete) > 50:
            out.append(f'<p class="mut">... {len(report.incomplete) - 50} more (see --json)</p>')
    else:
        out.append('<p class="mut">No gap recorded.</p>')
    return out
