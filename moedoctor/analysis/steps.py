"""Where a rank is inside its training step, from its own stream: starting the step's work over, or
closing the step.

A training step issues a sequence of collectives; with gradient accumulation a part of it repeats
once per micro-batch (the forward all-gathers, the per-micro-batch reductions), and a closing part
follows the last micro-batch (the gradient reduce-scatter of the syncing micro-batch, the norm, the
optimizer's collectives, a token-count all-reduce). Comparing a rank's collective at the divergence
with what the same rank issued earlier in the same step tells which part it is in:

- ``restart``: the collective (same op, call site and FSDP unit) was already issued in this step
  and a backward pass ran since: the rank began another pass over the step's repeated part (another
  micro-batch, or the next iteration when it skipped its optimizer step);
- ``closing``: the collective was not issued yet in this step, and the rank ran a backward pass in
  it: it left the repeated part and is closing the step.

The step is the recorder's counter (advanced by the primary optimizer's step hook), the backward
passes its ``backward`` hook. No names are read.
"""

from __future__ import annotations

from moedoctor.analysis.view import RunView
from moedoctor.events import CollectiveEvent

RESTART, CLOSING = "restart", "closing"


def token(e: CollectiveEvent) -> tuple:
    site = None if e.call_site is None else (e.call_site.file, e.call_site.line)
    return e.op, site, e.module


def position(view: RunView, event: CollectiveEvent) -> str | None:
    """``restart``, ``closing`` or None (no backward pass in this step yet, or nothing to tell)."""
    rank, group = event.rank, event.group.name
    earlier = [e for e in view.events(rank, group, before=event.seq) if e.step == event.step]
    backwards = [b.time for b in view.evidence(rank, "backward_begin", event.step) if b.time < event.time]
    if not backwards:
        return None
    same = [e for e in earlier if token(e) == token(event)]
    if same:
        return RESTART if any(t > same[-1].time for t in backwards) else None
    return CLOSING
