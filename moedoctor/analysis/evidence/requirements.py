"""Requirements more than one pattern declares (``analysis.patterns``): domain evidence read from
the run at the divergence. A pattern's own requirements live in its module, beside its classifier.

A requirement is ``holds(ctx, mechanism) -> bool`` with the words the report uses when it does not
hold; it reads only from its pattern's declared ``reads``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moedoctor.events import Phase


@dataclass(frozen=True)
class Requirement:
    """One piece of domain evidence a pattern needs: ``holds(ctx, mechanism)``."""

    name: str
    holds: Callable[..., bool]


def any_of(*requirements: Requirement) -> Requirement:
    """Holds when one of ``requirements`` does."""

    def holds(ctx, mech) -> bool:
        return any(r.holds(ctx, mech) for r in requirements)

    return Requirement(" or ".join(r.name for r in requirements), holds)


_CHECKPOINT = (Phase.CHECKPOINT_SAVE, Phase.CHECKPOINT_LOAD)
#: How many collectives before the divergence a checkpoint phase counts as "at" it.
WINDOW = 32


def _groups(ctx) -> list[tuple[str, int]]:
    found = [(ctx.div.group.name, ctx.div.seq)] if ctx.div is not None else []
    found += [(e.group, e.seq) for e in ctx.cycle or ()]
    return found


def checkpoint_io(ctx, mech) -> bool:
    """A checkpoint save or load (the recorder's checkpoint phases) among the collectives leading to
    the divergence, on any rank of it, or a rank that entered a checkpoint writer in that step."""
    if ctx.div is None:
        return False
    ranks = set(ctx.div.per_rank) | {r for e in ctx.cycle or () for r in (e.rank, *e.waits_for)}
    for group, seq in _groups(ctx):
        for r in ranks:
            if any(e.phase in _CHECKPOINT for e in ctx.view.events(r, group, before=seq + 1)[-WINDOW:]):
                return True
    step = mech.step if mech is not None else None
    return any(
        e.step in (step, None) or step is None for r in ranks for e in ctx.view.evidence(r, "checkpoint_save_begin")
    )


CHECKPOINT_IO = Requirement(
    "a checkpoint save or load (checkpoint phase or checkpoint writer) at the divergence", checkpoint_io
)

_GATHERS = ("all_gather", "gather", "all_gather_coalesced")


def gather_loop(ctx, mech) -> bool:
    """The collectives at the divergence include gathers (``all_gather_object``'s size and payload
    gathers, a DTensor's ``full_tensor``) issued outside the forward and backward passes by no
    sharded unit: a walk over a state's items, not a training step's collectives."""
    return any(
        v.op in _GATHERS and v.module is None and v.phase not in (Phase.FORWARD.value, Phase.BACKWARD.value)
        for v in ctx.present().values()
    )


GATHER_LOOP = Requirement(
    "gathers outside the training passes (a walk over a state's items) at the divergence", gather_loop
)


def variable_size_op(ctx, mech) -> bool:
    """The collective at the divergence is one whose sizes legitimately vary per rank (all_to_all,
    gather, scatter)."""
    return any(v.op in ("all_to_all", "gather", "scatter", "all_to_all_single") for v in ctx.present().values())


VARIABLE_SIZE_OP = Requirement(
    "a variable-size collective (all_to_all, gather, scatter) at the divergence", variable_size_op
)
