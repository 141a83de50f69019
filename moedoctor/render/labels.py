"""Words shown to a user for values whose JSON form is a schema (``docs/report-format.md``)."""

from __future__ import annotations

#: How each recorded phase reads in the terminal and HTML reports and the live status. The JSON value
#: stays ``other`` (the trace and report schemas); on screen it says where the collective was issued.
PHASE_LABELS = {"other": "outside forward/backward"}


def phase_label(phase: str | None) -> str:
    """``"other"`` -> ``"outside forward/backward"``; every other phase (``forward``, ``backward``,
    ``optimizer``...) as recorded."""
    if phase is None:
        return "?"
    return PHASE_LABELS.get(phase, phase)
