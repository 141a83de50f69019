"""Level 2's contract: what each pattern refines and the domain evidence it needs, in one place.

A pattern (``analysis.patterns``) is named only when the divergence's mechanism
(``analysis.mechanism``) is one it refines and every evidence it requires is present in the run.
Otherwise the report names the mechanism, and says per candidate pattern what was missing. The
patterns' scores still rank the admitted candidates; they can no longer make a name out of signals
that the pattern's defining evidence is absent from (a per-item loop read as a checkpoint save in
a job that saves nothing).

``reads`` lists every source of domain evidence a pattern's classifier may read (recorder evidence
records ``evidence:<kind>``, the ranks' ``stacks``, ``process`` states, ``exception`` records,
``exits``, the step-discard accessors); ``tests/unit/test_declarations.py`` runs every classifier
against a recording view and checks that it reads nothing else. The requirements read only from
their pattern's ``reads``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from moedoctor.analysis.mechanism import Mechanism as M
from moedoctor.analysis.mechanism import MechanismFinding, RankState
from moedoctor.analysis.steps import another_pass
from moedoctor.events import Phase

#: Evidence the sources classifiers read.
STACKS = frozenset({"stack", "stack_frame", "in_distributed"})
PROCESS = frozenset({"process", "frozen", "frozen_ranks"})
EXCEPTION = frozenset({"exception", "exception_line"})
EXITS = frozenset({"exit_code", "died", "finished"})
STEPS = frozenset({"discarded_steps", "discarded_in", "stepped", "nonfinite_loss"})
#: The job's own source, read at the stacks' lines (``analysis.source``); declared, not recorded
#: by the test's view proxy.
SOURCE = frozenset({"source"})
#: ``moedoctor run``'s account of the silences it judged busy (``RunView.busy_records``).
BUSY = frozenset({"busy_records"})


def ev(*kinds: str) -> frozenset[str]:
    return frozenset(f"evidence:{k}" for k in kinds)


@dataclass(frozen=True)
class Requirement:
    """One piece of domain evidence a pattern needs: ``holds(ctx, mechanism)``."""

    name: str
    holds: Callable[..., bool]


@dataclass(frozen=True)
class Declaration:
    pattern: str
    refines: frozenset[M]
    requires: tuple[Requirement, ...]
    reads: frozenset[str] | set[str]


# ---- the requirements ---------------------------------------------------------------------------

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


_MEMBER = re.compile(r"\.\d+(\.|$)|:\d+$")


def experts_without_gradients(ctx, mech) -> bool:
    """Some rank's recorder listed parameters of indexed module-list members without a gradient
    (``...experts.2.w1``, stacked ``moe.wi:4``) at the end of a backward or at an optimizer step; or,
    at the divergence, the ranks reduce the gradients of sharded units (FSDP, ``mod`` set) in
    backward with different sizes or different units (a unit's parameters got no gradient on some);
    or some ranks left out the collectives of sharded units that are indexed module-list members
    (``inactive_experts.member_units_left_out``: the experts they did not run)."""
    if ctx.div is None:
        return False
    present = ctx.present()
    units = [v for v in present.values() if v.module is not None and v.phase == Phase.BACKWARD.value]
    if len(units) == len(present) > 1 and len({(v.module, v.shapes) for v in units}) > 1:
        return True
    from moedoctor.analysis.patterns.inactive_experts import member_units_left_out

    if member_units_left_out(ctx):
        return True
    for r in ctx.div.per_rank:
        for e in ctx.view.evidence(r, "params_without_grad"):
            names = e.data.get("params") or e.data.get("names") or {}
            if any(_MEMBER.search(str(n)) for n in names):
                return True
    return False


def checkpoint_raised(ctx, mech) -> bool:
    """A rank raised, uncaught, an exception of ``torch.utils.checkpoint`` (its recompute check)."""
    from moedoctor.analysis.patterns.checkpoint_recompute_mismatch import checkpoint_exception

    ranks = set(ctx.div.per_rank) if ctx.div is not None else set()
    ranks |= {r for e in ctx.edges for r in e.waits_for}
    return any((x := ctx.view.exception(r)) is not None and checkpoint_exception(x) for r in ranks)


_GATHERS = ("all_gather", "gather", "all_gather_coalesced")


def gather_loop(ctx, mech) -> bool:
    """The collectives at the divergence include gathers (``all_gather_object``'s size and payload
    gathers, a DTensor's ``full_tensor``) issued outside the forward and backward passes by no
    sharded unit: a walk over a state's items, not a training step's collectives."""
    return any(
        v.op in _GATHERS and v.module is None and v.phase not in (Phase.FORWARD.value, Phase.BACKWARD.value)
        for v in ctx.present().values()
    )


def recomputed_in_backward(ctx, mech) -> bool:
    """A rank issued, in backward, a collective from a call site it issued in forward earlier in
    the same step (the recompute of a checkpointed region)."""
    if ctx.div is None:
        return False
    for r, v in ctx.present().items():
        if v.phase != Phase.BACKWARD.value or v.call_site is None:
            continue
        if any(
            e.phase == Phase.FORWARD
            and e.step == v.step
            and e.call_site is not None
            and e.call_site.where == v.call_site
            for e in ctx.view.events(r, ctx.div.group.name, before=ctx.div.seq)
        ):
            return True
    return False


def sharded_or_bucketed_other_side(ctx, mech) -> bool:
    """At the divergence some rank issued a collective of a sharded unit (FSDP, ``mod`` set) or of
    backward (a gradient bucket): what a misplaced metric all-reduce meets."""
    return any(v.module is not None or v.phase == Phase.BACKWARD.value for v in ctx.present().values())


def gradient_accumulation(ctx, mech) -> bool:
    """Some rank ran more than one backward pass within one step (micro-batches), or began the
    step's repeated part again after a backward pass of the step (``steps.position``: restart)."""
    if ctx.div is None:
        return False
    if "restart" in ctx.positions().values():
        return True
    for r in ctx.div.per_rank:
        steps = [e.step for e in ctx.view.evidence(r, "backward_begin")]
        if any(steps.count(s) > 1 for s in set(steps)):
            return True
    return False


def another_pass_begun(ctx, mech) -> bool:
    """The ranks are in different micro-batches at the divergence: they had begun different numbers
    of backward passes in the step when they issued its collectives, or a rank issued again a
    collective that opens each pass (first issued in the step before its first backward pass: a
    forward all-gather, a per-micro-batch count). A collective issued after each backward pass (a
    per-micro-batch metric) issued again by a rank that has run as many passes as the others is not
    another pass: its reductions were held back, the ranks are in the same micro-batch."""
    if ctx.div is None:
        return False
    events = [e for r in ctx.div.per_rank if (e := ctx.event(r)) is not None]
    return another_pass(ctx.view, events, ctx.positions())


def optimizer_step_signs(ctx, mech) -> bool:
    """The optimizer's own hooks or values: a rank began ``optimizer.step`` or cleared its gradients,
    a non-finite loss or gradient norm, a discarded step, or an inf/NaN test separating the ranks."""
    if ctx.div is None:
        return False
    view = ctx.view
    for r in ctx.div.per_rank:
        if view.evidence(r, "optimizer_step_begin") or view.evidence(r, "zero_grad") or view.discarded_steps(r):
            return True
        if any(str(e.data.get("finite")).lower() == "false" for e in view.evidence(r, "grad_norm")):
            return True
        if any(view.nonfinite_loss(r, s) for s in {e.step for e in view.evidence(r, "loss")}):
            return True
    from moedoctor.analysis.source import checks_finiteness

    branch = ctx.decision()
    return branch is not None and checks_finiteness(branch)


def waited_rank_working(ctx, mech) -> bool:
    """The stacks show a rank the others wait for running outside ``torch.distributed``; or, when the
    waiting ranks' own collective timeout ended the job, ``moedoctor run``'s busy record showed the
    awaited ranks working outside any collective for the whole wait, and they did not crash
    (``straggler.outlasted_wait``)."""
    if mech is not None and mech.state == RankState.WORKING:
        return True
    from moedoctor.analysis.patterns.straggler import outlasted_wait

    return outlasted_wait(ctx) is not None


def process_not_running(ctx, mech) -> bool:
    """A rank's process state (read from /proc at the hang) says it does not run."""
    return bool(ctx.view.frozen_ranks)


def variable_size_op(ctx, mech) -> bool:
    """The collective at the divergence is one whose sizes legitimately vary per rank (all_to_all,
    gather, scatter)."""
    return any(v.op in ("all_to_all", "gather", "scatter", "all_to_all_single") for v in ctx.present().values())


def size_unexplained(ctx, mech) -> bool:
    """The sizes differ for no structural reason the trace shows: not a variable-size collective
    (whose sizes the pairwise contract judges), and not a walk of gathers over a state's items inside
    a checkpoint save or load (ranks at different items of the walk, not one collective resized)."""
    if variable_size_op(ctx, mech):
        return False
    return not (gather_loop(ctx, mech) and checkpoint_io(ctx, mech))


#: What the report says is missing when a requirement does not hold.
NAMES = {
    "checkpoint_io": "a checkpoint save or load (checkpoint phase or checkpoint writer) at the divergence",
    "gather_loop": "gathers outside the training passes (a walk over a state's items) at the divergence",
    "experts_without_gradients": "module-list members (experts) without gradients on some rank",
    "checkpoint_raised": "an exception raised by torch.utils.checkpoint's recompute check",
    "recomputed_in_backward": "a forward call site re-issued in backward (a recompute)",
    "sharded_or_bucketed_other_side": "a sharded-unit (FSDP) or backward-bucket collective on the other side",
    "gradient_accumulation": "more than one backward pass in a step (micro-batches)",
    "another_pass_begun": (
        "ranks in different micro-batches (different backward-pass counts, or a pass-opening collective issued again)"
    ),
    "optimizer_step_signs": (
        "optimizer-step evidence (step or zero_grad hooks, a non-finite value, a discarded step, an inf/NaN test)"
    ),
    "waited_rank_working": (
        "a stack (or a busy record lasting until the others' timeout) showing the waited-for rank working "
        "outside torch.distributed"
    ),
    "process_not_running": "a process state showing a rank that does not run",
    "variable_size_op": "a variable-size collective (all_to_all, gather, scatter) at the divergence",
    "size_unexplained": (
        "sizes that differ for no structural reason (not a variable-size collective,"
        " not a checkpoint's walk of gathers)"
    ),
}


def _req(fn: Callable[..., bool]) -> Requirement:
    return Requirement(NAMES[fn.__name__], fn)


def _any(*fns: Callable[..., bool]) -> Requirement:
    def holds(ctx, mech) -> bool:
        return any(f(ctx, mech) for f in fns)

    return Requirement(" or ".join(_req(f).name for f in fns), holds)


_DESYNC = frozenset({M.EXTRA_COLLECTIVE, M.SKIPPED_COLLECTIVE, M.DIFFERENT_OP, M.LOOP_TRIP_COUNT, M.WAIT_CYCLE})
_SAME_POSITION = frozenset({M.DIFFERENT_SHAPE, M.DIFFERENT_DTYPE, M.DIFFERENT_REDUCE_OP})

DECLARATIONS: dict[str, Declaration] = {
    d.pattern: d
    for d in (
        Declaration(
            "uneven-dtensor-allgather",
            _DESYNC | _SAME_POSITION | {M.RANK_OUTSIDE},
            (_any(checkpoint_io, gather_loop),),
            ev("checkpoint_save_begin") | SOURCE,
        ),
        Declaration(
            "inactive-experts",
            _DESYNC | _SAME_POSITION | {M.RANK_OUTSIDE},
            (_req(experts_without_gradients),),
            ev("params_without_grad", "backward_begin", "backward_end") | {"exception"},
        ),
        Declaration(
            "checkpoint-recompute-mismatch",
            _DESYNC | _SAME_POSITION | {M.RANK_OUTSIDE},
            (_req(checkpoint_raised),),
            EXCEPTION | {"died"},
        ),
        Declaration(
            "collective-in-checkpointed-region",
            _DESYNC | _SAME_POSITION | {M.RANK_OUTSIDE},
            (_req(recomputed_in_backward),),
            frozenset({"stack"}),
        ),
        Declaration(
            "inflight-metric-allreduce",
            _DESYNC | _SAME_POSITION,
            (_req(sharded_or_bucketed_other_side),),
            ev("backward_begin", "backward_end") | {"discarded_in"} | SOURCE,
        ),
        Declaration(
            "microbatch-count-mismatch",
            _DESYNC | _SAME_POSITION | {M.RANK_OUTSIDE},
            (_req(gradient_accumulation), _req(another_pass_begun)),
            ev("backward_begin", "backward_end", "grad_norm", "optimizer_step_begin", "zero_grad")
            | {"discarded_in"}
            | SOURCE,
        ),
        Declaration(
            "skipped-optimizer-step",
            _DESYNC | _SAME_POSITION | {M.RANK_OUTSIDE},
            (_req(optimizer_step_signs),),
            ev("backward_begin", "grad_norm", "loss", "optimizer_step_begin", "zero_grad") | STEPS | SOURCE,
        ),
        Declaration("rank-conditional-collective", _DESYNC | _SAME_POSITION, (), SOURCE),
        Declaration("collective-order-inversion", _DESYNC, (), SOURCE),
        Declaration(
            "shape-mismatch",
            _SAME_POSITION | {M.DIFFERENT_SPLITS, M.DIFFERENT_OP},
            (_req(size_unexplained),),
            ev("checkpoint_save_begin"),
        ),
        Declaration(
            "all-to-all-split-mismatch",
            frozenset({M.DIFFERENT_SPLITS, M.DIFFERENT_SHAPE}),
            (_req(variable_size_op),),
            frozenset(),
        ),
        Declaration(
            "straggler",
            frozenset({M.RANK_OUTSIDE}),
            (_req(waited_rank_working),),
            {"stack_frame", "in_distributed", "frozen", "died"} | EXCEPTION | EXITS | BUSY,
        ),
        Declaration(
            "rank-stopped",
            frozenset({M.RANK_OUTSIDE, M.TRANSPORT_HANG}),
            (_req(process_not_running),),
            {"frozen_ranks", "stack", "stack_frame", "in_distributed"},
        ),
        Declaration("not-a-desync", frozenset({M.TRANSPORT_HANG}), (), {"stack", "frozen"}),
        Declaration(
            "unknown-desync",
            frozenset(M),
            (),
            ev("backward_begin", "optimizer_step_begin") | {"died", "stack", "discarded_in"} | SOURCE,
        ),
    )
}


def missing(pattern: str, ctx, mech: MechanismFinding | None) -> list[str]:
    """What keeps ``pattern`` from being named here: the mechanism it does not refine, or each piece
    of required evidence that is absent (empty: admitted)."""
    decl = DECLARATIONS.get(pattern)
    if decl is None:
        return [f"{pattern} declares nothing"]
    if mech is not None and mech.mechanism not in decl.refines:
        return [f"a mechanism it refines (this one is {mech.mechanism.value})"]
    return [r.name for r in decl.requires if not r.holds(ctx, mech)]


def admits(pattern: str, mech: MechanismFinding) -> bool:
    """Whether ``pattern`` refines ``mech`` (the part of its declaration that needs no traces: a job
    known only by its stacks)."""
    decl = DECLARATIONS.get(pattern)
    return decl is not None and mech.mechanism in decl.refines
