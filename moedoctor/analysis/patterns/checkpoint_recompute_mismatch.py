"""``checkpoint-recompute-mismatch``: a checkpointed region recomputed differently, on one rank.

Mechanism: under non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``, ``checkpoint_wrapper``, transformers' gradient checkpointing) backward runs
the region's forward again and pairs the tensors it saves, one by one, with those the original
forward saved. An MoE block whose loop runs only the experts that received tokens saves a number of
tensors that depends on the routing; when the routing of the recompute differs from the forward's
(a load-balancing bias or load counter updated in the forward, router noise from a generator of its
own: state that checkpoint's RNG replay does not restore), fewer or more tensors, or tensors of
other shapes, are saved. ``torch.utils.checkpoint`` raises ``CheckpointError`` ("A different number
of tensors was saved during the original forward and recomputation", "trying to save more tensors
during recomputation", "Recomputed values ... have different metadata") in that rank's backward,
and the rank dies while the others wait in a backward collective of their FSDP2 units (seed 000:
"Patch MoE expert modules for FSDP2 + non-reentrant gradient checkpointing", "Make unpack_hook
tolerant of missing handles").

Evidence: the ranks the others wait for died, and one of them recorded an uncaught exception (the
``x`` record) raised by ``torch.utils.checkpoint`` itself: its class is that module's, or its
traceback ends in that module (an assert in its pack/unpack hooks or its recompute check; an error
that only passes through them, a collective failing inside a recompute, does not count; never the
job's own names);
it was raised in backward (autograd's engine in the traceback). The others wait in a collective of
the group at the divergence, in backward. The message gives the counts of tensors saved in forward
and recompute, or the shapes that differ (the rows of a token batch routed to an expert). The
record names the function checkpoint recomputed (read from checkpoint's own frame object), and the
module lists of same-class members (experts) in its module, or its members stacked in parameters of
one leading dimension (fused experts: ``wi[e]``, ``wo[e]``).

Scores: 0.8 with all of it; lower, each said in the evidence, when the exception was not raised in
backward, the others are not waiting in backward, the message does not say what differed, the
checkpointed function was not recorded, or its module holds no list of same-class members (the
``expert-dense`` fix then has nothing to densify: another source of non-determinism in the region).
When no rank is left waiting (every rank raised it at the same collective: no divergence) the
finding stands on the exceptions alone (-0.2). No finding without the exception record: a rank
killed by a signal (SIGKILL, Gloo's SIGABRT) writes none, and the crash stays a crash.
``CheckpointError`` for a tensor unpacked twice (a double backward) is not a recompute mismatch:
no finding.

Risk: any state that changes between forward and recompute reads alike (a dropout mask from a
generator of its own in a dense layer); the module-list evidence is what points at experts, and its
absence lowers the score below the expert-specific call.

Fix ``expert-dense``: every expert runs on every token (unrouted tokens weighted by zero), so the
region saves the same tensors whatever the routing. The lasting fix is to keep routing state out of
the forward (update load-balancing biases after the optimizer step; draw router noise from the
global generator that checkpoint replays).
"""

from __future__ import annotations

import re

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.evidence.view import user_frame
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import (
    DESYNC,
    EXCEPTION,
    SAME_POSITION,
    Context,
    Declaration,
    Finding,
    Pattern,
    names,
)
from moedoctor.events import Phase, RankException
from moedoctor.wording import phase_label


_CHECKPOINT_FILE = "torch/utils/checkpoint.py"
_MODULE = "torch.utils.checkpoint."

_COUNTS = re.compile(
    r"saved during forward: (\d+)\s*\n\s*Number of tensors saved during recomputation: (\d+)", re.IGNORECASE
)
_MORE = "trying to save more tensors during recomputation"
_METADATA = re.compile(r"saved metadata: (\{[^\n]*\})\s*\n\s*recomputed metadata: (\{[^\n]*\})")
_SHAPE = re.compile(r"torch\.Size\(\[([^\]]*)\]\)")
_TWICE = "already unpacked once"

_ADVICE = (
    "make the checkpointed MoE block save the same tensors in forward and recompute: run every expert "
    "on every token (expert-dense), and keep routing state (load-balancing bias, load counters, router "
    "noise from a generator of its own) from changing inside the forward"
)


def checkpoint_exception(exc: RankException) -> bool:
    """Raised by ``torch.utils.checkpoint`` itself: its class is that module's, or the traceback's
    innermost frame is that module's (an assert in its pack/unpack hooks or its recompute check). An
    exception that only passes through its hooks (a collective failing inside a recompute) is not."""
    if exc.type.startswith(_MODULE):
        return True
    inner = exc.frames[-1] if exc.frames else None
    return inner is not None and inner.file.replace("\\", "/").endswith(_CHECKPOINT_FILE)


def what_differed(message: str) -> str | None:
    """What the message says differed between forward and recompute (None: it does not say)."""
    counts = _COUNTS.search(message)
    if counts:
        fwd, rec = int(counts.group(1)), int(counts.group(2))
        return f"{fwd} tensors saved in forward, {rec} in recompute ({'fewer' if rec < fwd else 'more'} in recompute)"
    if _MORE in message:
        return "more tensors saved in recompute than in forward"
    meta = _METADATA.findall(message)
    if meta:
        pairs = []
        for saved, recomputed in meta[:3]:
            a, b = _SHAPE.search(saved), _SHAPE.search(recomputed)
            if a and b and a.group(1) != b.group(1):
                pairs.append(f"[{a.group(1)}] in forward, [{b.group(1)}] in recompute")
        more = f" and {len(meta) - 3} more" if len(meta) > 3 else ""
        shapes = f": {'; '.join(pairs)}" if pairs else ""
        return f"{len(meta)} saved tensor(s) of other metadata in recompute{shapes}{more}"
    return None


def classify(ctx: Context) -> Finding | None:
    div, view = ctx.div, ctx.view
    if div is not None and not div.missing:
        return None  # a mismatch between issued collectives: another pattern's
    # The ranks the others wait for; with no divergence (every rank raised, none is left waiting),
    # every rank that died.
    awaited = div.missing if div is not None else [r for r in view.ranks if view.died(r)]
    raised = {r: exc for r in awaited if view.died(r) and (exc := view.exception(r)) is not None}
    raised = {r: exc for r, exc in raised.items() if checkpoint_exception(exc)}
    if not raised:
        return None
    rank, exc = min(raised.items(), key=lambda item: item[1].time)
    if _TWICE in exc.message:
        return None  # a tensor unpacked twice: a double backward, not a recompute that differed
    score = 0.8
    evidence = []
    site = user_frame(exc)
    evidence.append(view.exception_line(rank) or f"rank {rank} raised {exc.type}")
    if exc.phase != Phase.BACKWARD:
        score -= 0.2
        evidence.append(
            f"the exception was raised in {phase_label(exc.phase.value)}, not in backward's recompute (-0.2)"
        )
    differed = what_differed(exc.message)
    if differed is not None:
        evidence.append(f"forward and recompute differed: {differed}")
    else:
        score -= 0.1
        evidence.append("the message does not say what differed between forward and recompute (-0.1)")
    ckpt = exc.checkpointed
    if ckpt is None:
        score -= 0.1
        evidence.append("the checkpointed function was not recorded (no checkpoint frame in the traceback) (-0.1)")
    else:
        owner = f" of {ckpt.module}" if ckpt.module else ""
        evidence.append(f"checkpointed region: {ckpt.function}{owner} ({ckpt.short})")
        lists = [n for n in ckpt.module_lists if "{" not in n]
        stacked = [n for n in ckpt.module_lists if "{" in n]
        if lists:
            evidence.append(f"it holds module list(s) of same-class members, run per routed member: {_members(lists)}")
        if stacked:
            evidence.append(
                f"it holds members stacked in parameters of a leading dimension each (fused experts): "
                f"{_members(stacked)}; expert-dense rewrites module lists only"
            )
        if not ckpt.module_lists:
            score -= 0.25
            evidence.append(
                "its module holds no list of same-class members (experts), listed or stacked: the recompute "
                "differs for another reason, and expert-dense may not apply (-0.25)"
            )
    present = ctx.present()
    waiting = {r: v for r, v in present.items() if not v.completed or _failed_in(ctx, r)}
    if div is None:
        score -= 0.2
        evidence.append(
            f"no collective divergence was recorded: {names(sorted(raised))} raised it and no rank is left "
            "waiting for another (-0.2)"
        )
    elif waiting:
        v = next(iter(waiting.values()))
        evidence.append(
            f"{names(sorted(waiting))} wait{'s' if len(waiting) == 1 else ''} in {v.op} #{div.seq} of group "
            f"{div.group.label()} ({v.short_site}, {phase_label(v.phase)}) that {names(div.missing)} never issued"
            + (
                f" ({names(failed)} until it failed, once the rank it waited for was gone)"
                if (failed := sorted(r for r, x in waiting.items() if x.completed))
                else ""
            )
        )
        if any(v.phase != Phase.BACKWARD.value for v in waiting.values()):
            score -= 0.1
            evidence.append("the others do not wait in backward (-0.1)")
    else:
        score -= 0.1
        evidence.append(f"no rank is recorded waiting in #{div.seq} of group {div.group.label()} (-0.1)")
    call_site = site.where if site is not None else None
    suggestion = Suggestion(
        ckpt.file + f":{ckpt.line}" if ckpt is not None else call_site,
        ckpt.function if ckpt is not None else (site.function if site is not None else None),
        _ADVICE,
    )
    return Finding(
        round(score, 2), tuple(evidence), culprits=tuple(sorted(raised)), suggestion=suggestion, explains_crash=True
    )


def _members(found: list[str]) -> str:
    return ", ".join(f"{n.rpartition(':')[0] or '(the module)'} ({n.rpartition(':')[2]} members)" for n in found[:4])


def _failed_in(ctx: Context, rank: int) -> bool:
    """The rank's collective at the divergence ended only because it failed: the rank raised after
    issuing it (Gloo's "Connection closed by peer" once the awaited rank died) and issued nothing
    after it. Its work then reads as completed, though the rank was waiting."""
    event, exc = ctx.event(rank), ctx.view.exception(rank)
    last = ctx.view.last_event.get(rank)
    return event is not None and exc is not None and exc.time >= event.time and last is event


# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


def checkpoint_raised(ctx, mech) -> bool:
    """A rank raised, uncaught, an exception of ``torch.utils.checkpoint`` (its recompute check)."""
    ranks = set(ctx.div.per_rank) if ctx.div is not None else set()
    ranks |= {r for e in ctx.edges for r in e.waits_for}
    return any((x := ctx.view.exception(r)) is not None and checkpoint_exception(x) for r in ranks)


CHECKPOINT_RAISED = Requirement("an exception raised by torch.utils.checkpoint's recompute check", checkpoint_raised)


DECLARATION = Declaration(
    "checkpoint-recompute-mismatch",
    DESYNC | SAME_POSITION | {M.RANK_OUTSIDE},
    (CHECKPOINT_RAISED,),
    EXCEPTION | {"died"},
)

PATTERN = Pattern(
    id="checkpoint-recompute-mismatch",
    title="Activation checkpoint recompute differs from forward",
    fixes=("expert-dense",),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
