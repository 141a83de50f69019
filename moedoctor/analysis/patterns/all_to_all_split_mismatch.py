"""``all-to-all-split-mismatch``: the ranks disagree on how many rows travel between them.

Mechanism: expert-parallel token dispatch sends each expert's tokens with ``all_to_all_single``
and uneven, data-dependent splits. The receive counts must come from the senders (an all_to_all of
the counts first); a rank that computes its ``output_split_sizes`` locally (from its own routing, a
stale step, a capacity formula) expects a different number of rows than its peers send. Gloo aborts
with a size error, NCCL hangs or silently mixes tokens. The same holds for ``gather`` / ``scatter``
lists against the peers' tensors.

Evidence: every member issued the same op at one sequence number (so the signature agrees), and
the pairwise contract breaks: rank i's output split for j differs from rank j's input split for i
(``analysis.contracts``). The culprit is the rank every breach names as the receiver (or sender).
Uneven splits that respect the contract are healthy and never reach this pattern.

Risk: low; the breach is arithmetic on recorded sizes. Which side is wrong is inferred (the one
rank all breaches share); when several ranks' receive counts are off, all of them are named.

Fix: exchange the counts first (``all_to_all_single`` of the per-expert counts) and use what was
received as ``output_split_sizes``; never derive receive counts locally.

Variants covered: ``tests/jobs/a2a_split_mismatch.py`` (counts computed locally), the held-out EP jobs.

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 5 variants of
`fixtures/variants/all-to-all-split-mismatch/` (c10d, functional and autograd all_to_all_single; 2-4
ranks; default group and an EP subgroup of a 2-D mesh): 5/5 named. Confusions seen: none; culprits
5/5 since the breakers are the ranks in the most breaches (a 3-rank capacity-padded dispatch named
every receiver before) and the divergence keeps them last (a 2-rank stale receiver was named as its
peer when the classes were sorted by size).
"""

from __future__ import annotations

import math

from moedoctor.analysis.contracts import breaches
from moedoctor.analysis.evidence.requirements import VARIABLE_SIZE_OP
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import DivergenceKind, Suggestion
from moedoctor.analysis.patterns.base import Context, Declaration, Finding, Pattern, names


def classify(ctx: Context) -> Finding | None:
    div = ctx.div
    if div is None or div.kind != DivergenceKind.CONTRACT:
        return None
    bad = div.classes[-1] if div.classes else ()  # the breakers' class (every rank when all disagree)
    v = next((div.per_rank[r] for r in bad if div.per_rank.get(r) is not None), None)
    v = v or next(x for x in div.per_rank.values() if x is not None)
    evidence = [
        f"every rank of group {div.group.label()} issued {v.op} #{div.seq} ({v.short_site}), but the sizes "
        f"they exchange do not pair up: "
        + "; ".join(div.breaches[:6])
        + (f" (and {len(div.breaches) - 6} more)" if len(div.breaches) > 6 else "")
    ]
    if v.splits is not None:
        evidence.append(
            "splits (input / output rows per member): "
            + "; ".join(
                f"rank {r}: {list(x.splits[0]) or 'equal'} / {list(x.splits[1]) or 'equal'}"
                for r, x in div.per_rank.items()
                if x is not None and x.splits is not None
            )
        )
    exchanged = _counts_exchanged(ctx, bad)
    if exchanged is not None:
        evidence.append(exchanged)
        bad = ()
    elif bad:
        evidence.append(
            f"{names(bad)} disagree{'s' if len(bad) == 1 else ''} with the peers "
            f"{'it exchanges' if len(bad) == 1 else 'they exchange'} with: receive counts not taken "
            "from what the senders announced"
        )
    return Finding(
        0.95, tuple(evidence), culprits=tuple(bad) or None, suggestion=Suggestion(v.call_site, v.function, _ADVICE)
    )


_INTEGER = ("int64", "int32", "int16", "uint8", "int8")


def _counts_exchanged(ctx: Context, bad: tuple[int, ...]) -> str | None:
    """One pair breaks the contract (one receiver, one sender: nothing says which side is wrong but
    the habit that receive counts are computed locally), yet both exchanged integer counts on this
    group earlier in the step (an all_to_all of a small integer tensor), with no dispatch from this
    call site in between (counts cached from an earlier exchange are the receiver's): it then took its
    counts from the sender's announcement, or changed them after, and the sender may send other rows
    than it announced. The counts' values are not recorded, so the culprit is left open, the sentence
    says why; unless the receiver's receive splits are its own send splits (and the sender's are not):
    computed locally after all, the receiver's (the bundled fixture)."""
    div, view = ctx.div, ctx.view
    events = {r: e for r in div.per_rank if (e := ctx.event(r)) is not None}
    found = breaches(events, tuple(sorted(events)))
    if len(found) != 1:
        return None
    b = found[0]
    seen = []
    for r in (b.receiver, b.sender):
        event = events[r]
        counts = [
            e
            for e in view.events(r, div.group.name, before=div.seq)
            if e.op == "all_to_all"
            and e.step == event.step
            and e.dtypes
            and e.dtypes[0] in _INTEGER
            and sum(math.prod(shape) for shape in e.in_shapes) <= 4096
        ]
        if not counts:
            return None
        site = event.call_site.where if event.call_site else None
        since = view.events(r, div.group.name, before=div.seq)
        if site is None or any(e.seq > counts[-1].seq and e.call_site and e.call_site.where == site for e in since):
            return None  # the exchange fed an earlier dispatch from this call site: its counts may be cached
        seen.append(counts[-1])
    mine, theirs = events[b.receiver], events[b.sender]
    if mine.in_splits and mine.in_splits == mine.out_splits and theirs.in_splits != theirs.out_splits:
        return None  # its receive counts are its own send counts: computed locally, the receiver's
    return (
        f"rank {b.receiver} and rank {b.sender} exchanged integer counts on this group before it (#{seen[0].seq}, "
        f"{seen[0].call_site.short if seen[0].call_site else '?'}): "
        f"rank {b.receiver}'s receive count follows an announcement, so either rank {b.sender} sends other rows "
        f"than it announced or rank {b.receiver} changed what it received; the counts' values are not "
        "recorded, so no culprit is named"
    )


_ADVICE = (
    "Exchange the per-destination counts first (dist.all_to_all_single on the counts tensor) and pass "
    "what was received as output_split_sizes; never compute the receive counts locally."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------

DECLARATION = Declaration(
    "all-to-all-split-mismatch", frozenset({M.DIFFERENT_SPLITS, M.DIFFERENT_SHAPE}), (VARIABLE_SIZE_OP,), frozenset()
)

PATTERN = Pattern(
    id="all-to-all-split-mismatch",
    title="all_to_all split mismatch",
    fixes=(),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
