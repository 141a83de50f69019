"""How reports word recurring things, written once: lists of ranks, phases."""

from __future__ import annotations

from collections.abc import Iterable


def rank_names(ranks: Iterable[int], *, ranges: bool = False) -> str:
    """``rank 3`` / ``ranks 0,2,5`` (``ranks 0-3,8`` with ``ranges``) / ``no rank``."""
    ranks = sorted(ranks)
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + (rank_ranges(ranks) if ranges else ",".join(map(str, ranks)))


def rank_ranges(ranks: Iterable[int], limit: int | None = None) -> str:
    """``0-3,8``: runs of consecutive ranks; past ``limit`` runs, ``... and 4 more ranges``."""
    ranks = sorted(ranks)
    out: list[str] = []
    start = None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    if limit is not None and len(out) > limit:
        return ",".join(out[:limit]) + f" and {len(out) - limit} more ranges"
    return ",".join(out)


def rank_numbers(ranks: Iterable[int], limit: int = 8) -> str:
    """``0, 1, 5`` / ``0, 1, 2, 3, 4, 5, 6, 7 and 4 more``: the numbers alone, for a sentence that
    names them already."""
    ranks = sorted(ranks)
    if len(ranks) > limit:
        return f"{', '.join(map(str, ranks[:limit]))} and {len(ranks) - limit} more"
    return ", ".join(map(str, ranks))


#: How a recorded phase reads on screen (terminal and HTML reports, the live status). The JSON value
#: stays ``other`` (the trace and report schemas, docs/report-format.md); on screen it says where the
#: collective was issued.
PHASE_LABELS = {"other": "outside forward/backward"}


def phase_label(phase: str | None) -> str:
    """``"other"`` -> ``"outside forward/backward"``; every other phase (``forward``, ``backward``,
    ``optimizer``...) as recorded."""
    if phase is None:
        return "?"
    return PHASE_LABELS.get(phase, phase)
