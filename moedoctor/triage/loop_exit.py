"""Which ranks left a loop that the others are still in, from the ranks' stacks and the job's source:
the culprit of a desync that ``moedoctor triage`` reads from stacks alone.

With two ranks in different collectives the stacks give no majority, so ``report_from_stacks`` names
no culprit. The job's own frames often do: when both groups of ranks are in the same call of the
same function, one group at a line inside a loop and the other at a line after that loop (a
micro-batch loop one rank left after skipping a backward, an epoch loop one rank's shorter shard
ended), the ranks past the loop ran fewer iterations of it, or skipped the loop's collective in its
last one, and the ranks still inside wait for them. Those are the culprits, as the trace analysis
names them (``analysis/evidence/steps.py``, a loop one side left early).

Evidence required, else nothing is named: exactly two groups of ranks, each waiting in a collective;
their own frames (outside torch and installed packages) the same from the outermost frame down to
one function of one file, where the lines differ; the source of that file readable; one line inside
a loop the other is not in, the other after it and inside every other loop the first is in.
"""

from __future__ import annotations

from dataclasses import dataclass

from moedoctor.analysis.from_stacks import classify_stacks
from moedoctor.analysis.model import Report
from moedoctor.analysis.patterns.base import names
from moedoctor.analysis.evidence.source import Enclosing, enclosing, loops_around
from moedoctor.run_records import Frame, StackDump, is_library_frame

#: The report from stacks whose culprit this refines (ranks in different collectives, no majority).
REFINES = "unknown-desync"


@dataclass(frozen=True, slots=True)
class LeftLoop:
    """``left`` are past ``loop`` (at ``left_at``) while ``inside`` are still in it (at ``inside_at``)."""

    left: tuple[int, ...]
    inside: tuple[int, ...]
    loop: Enclosing
    left_at: Frame
    inside_at: Frame

    def reasoning(self) -> str:
        be = "is" if len(self.left) == 1 else "are"
        return (
            f"{names(self.left)} {be} past the loop of {self.loop.short} (`{self.loop.text}`), at line "
            f"{self.left_at.line} of {self.left_at.function}, while {names(self.inside)} "
            f"{'is' if len(self.inside) == 1 else 'are'} still inside it, at line {self.inside_at.line}: "
            f"{names(self.left)} ran fewer iterations of it or skipped its collective in the last one "
            "(stacks and source)"
        )


def _own_frames(dump: StackDump) -> list[Frame]:
    """The job's own main-thread frames, outermost first."""
    return [f for f in reversed(dump.main_thread) if not is_library_frame(f)]


def _function(frame: Frame) -> Enclosing | None:
    return next((e for e in reversed(enclosing(frame.file, frame.line)) if e.kind == "def"), None)


def left_loop(stacks: dict[int, StackDump]) -> LeftLoop | None:
    """The ranks past a loop the other ranks wait inside (None: the stacks and source do not show it)."""
    classes = classify_stacks(stacks)
    if len(classes) != 2 or any(c.stack.collective is None for c in classes):
        return None
    first, second = (_own_frames(stacks[c.ranks[0]]) for c in classes)
    for a, b in zip(first, second):
        if a == b:
            continue
        if (a.file, a.function) != (b.file, b.function):
            return None
        for (i, fi), (o, fo) in (((0, a), (1, b)), ((1, b), (0, a))):
            found = _past(fi, fo)
            if found is not None:
                return LeftLoop(classes[o].ranks, classes[i].ranks, found, fo, fi)
        return None
    return None


def _past(inside: Frame, out: Frame) -> Enclosing | None:
    """The loop around ``inside`` that ``out`` is after: ``out`` is in every loop around ``inside``
    but that one (and its inner ones), at a later line."""
    function = _function(inside)
    if function is None or function != _function(out):
        return None  # not both in the one function the source has there (edited, or a line beyond it)
    theirs, ours = loops_around(inside.file, inside.line), loops_around(out.file, out.line)
    if len(theirs) <= len(ours) or theirs[: len(ours)] != ours:
        return None
    loop = theirs[len(ours)]
    return loop if loop.line < out.line else None


def name_culprit(report: Report, stacks: dict[int, StackDump]) -> Report:
    """``report`` (from stacks) with the ranks past the loop as its culprits, where it names none."""
    if report.pattern != REFINES or report.culprit_ranks:
        return report
    found = left_loop(stacks)
    if found is None:
        return report
    report.culprit_ranks = sorted(found.left)
    report.culprit_reasoning = found.reasoning()
    report.evidence.append(
        f"{found.loop.short}: `{found.loop.text}` encloses line {found.inside_at.line} "
        f"({names(found.inside)}), not line {found.left_at.line} ({names(found.left)}) after it"
    )
    return report


__all__ = ["LeftLoop", "left_loop", "name_culprit"]
