"""``collective-in-checkpointed-region``: a collective inside an activation-checkpointed region is
issued again by the recompute in backward, on some ranks only.

Mechanism: ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`` runs ``fn`` again in
backward to rebuild the tensors its forward did not keep. A collective inside ``fn`` (Ulysses
sequence parallelism's all_gather of position_ids, an all_reduce of a token count) is then issued a
second time, in backward, interleaved with FSDP2's backward all-gathers and reduce-scatters. That is
harmless while every rank recomputes it at the same point. It deadlocks as soon as one rank's
recompute does not reach it: the non-reentrant checkpoint stops recomputing once every tensor the
forward saved is rebuilt (``set_checkpoint_early_stop``, on by default), so a rank whose forward
saved nothing after the collective (data-dependent control flow: a shard of padding only, experts
that got no token) never re-issues it, and a rank whose checkpointed output gets no gradient never
recomputes at all. The other ranks' recomputed collective then meets that rank's next backward
collective (FSDP2's reduce-scatter or the next unit's all-gather): NCCL hangs, Gloo aborts on the
size mismatch or times out (seed 001: "pre-gathers position_ids to avoid checkpoint-backward
all_gather deadlocks").

Evidence: at the divergence, a rank's collective was issued in phase ``backward`` (the recorder
derives it from autograd's current graph task, which the recompute runs under) from a call site
(file:line, same op, same group) the same rank issued in phase ``forward`` earlier in the same step:
a forward line issued during backward is the recompute. The re-issued stack repeats the forward's
inner frames (the same code path run again), and the rank's stack dump, when there is one, shows
``torch/utils/checkpoint.py`` frames around the collective. Another member issued a different
collective there (FSDP2's backward ones, with their unit) or none. It weighs: the other ranks issued
that call site in forward in this step too (forward agreed, only the recompute differs), and in
earlier steps every member re-issued it in backward (a healthy re-issue that stopped matching).

Risk: a helper shared by forward code and backward code (Megatron's sequence-parallel gather used by
one autograd Function's forward and another's backward) issues the same line in both phases without
any recompute: its callers differ, so the inner frames are not repeated, and without a stack dump
showing the checkpoint recompute the score stays below the threshold. A collective re-issued by
every rank at the same point is no divergence, so never this pattern.

Fix: hoist the collective out of the checkpointed region: issue it once before
``checkpoint(...)`` and pass its result in (or cache it for the step), as seed 001 does for Ulysses'
position_ids. Fix module ``recompute-cache-collective`` (by structure, ``fix_config`` ``regions:
checkpointed``, offered only when the recompute is shown): in the recompute it replays the results
the region's collectives returned in forward (inputs checked bitwise) instead of issuing them again.
"""

from __future__ import annotations

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import DivergenceKind, Suggestion
from moedoctor.analysis.patterns.base import DESYNC, SAME_POSITION, Context, Declaration, Finding, Pattern, names, verb
from moedoctor.events import CollectiveEvent, Phase
from moedoctor.wording import phase_label


#: A file of torch.utils.checkpoint (the recompute) in a stack dump's frames.
_CHECKPOINT_FILE = "torch/utils/checkpoint.py"


def _shared_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many innermost frames (``file:line function``) two stacks share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _outer_frames_from_forward(backward: tuple[str, ...], forward: tuple[str, ...]) -> bool:
    """Every frame of the backward stack beyond its first is of a function (file and name) that the
    forward stack has beyond its first frame."""
    seen = {(f.partition(" ")[0].rpartition(":")[0], f.partition(" ")[2]) for f in forward[1:]}
    return all((f.partition(" ")[0].rpartition(":")[0], f.partition(" ")[2]) in seen for f in backward[1:])


def _same_site(a: CollectiveEvent, b: CollectiveEvent) -> bool:
    return (
        a.op == b.op
        and a.group.name == b.group.name
        and a.call_site is not None
        and b.call_site is not None
        and a.call_site.where == b.call_site.where
    )


def _recompute_in_dump(ctx: Context, rank: int, e: CollectiveEvent) -> bool | None:
    """Whether the rank's stack dump shows the checkpoint's recompute under the call site: a thread
    with a ``torch/utils/checkpoint.py`` frame outside a frame of the call site's function (its line
    may be further on: a functional collective is waited for where its result is first used); None:
    no dump."""
    dump = ctx.view.stack(rank)
    site = e.call_site
    if site is None or dump is None or (not dump.threads and not dump.main_thread):
        return None

    def in_site(f) -> bool:
        return f.file == site.file and (f.function == site.function or f.function.endswith("." + site.function))

    for frames in list(dump.threads.values()) or [dump.main_thread]:
        at = next((i for i, f in enumerate(frames) if in_site(f)), None)
        if at is not None and any(f.file.replace("\\", "/").endswith(_CHECKPOINT_FILE) for f in frames[at:]):
            return True
    return False


def _reissued(ctx: Context, rank: int) -> tuple[CollectiveEvent, list[CollectiveEvent]] | None:
    """The rank's backward collective at the divergence and the forward issues of its call site in the
    same step (earlier on the same group), or None."""
    e = ctx.event(rank)
    if e is None or e.phase != Phase.BACKWARD or e.call_site is None or e.is_p2p:
        return None
    forward = [
        f
        for f in ctx.view.events(rank, e.group.name, before=e.seq)
        if f.step == e.step and f.phase == Phase.FORWARD and _same_site(f, e)
    ]
    return (e, forward) if forward else None


def _steps_with(ctx: Context, rank: int, e: CollectiveEvent, phase: Phase) -> list[int]:
    """The steps in which the rank issued ``e``'s call site in ``phase`` before the divergence."""
    events = ctx.view.events(rank, e.group.name, before=e.seq)
    return sorted({x.step for x in events if x.phase == phase and _same_site(x, e)})


def _label(view, name: str) -> str:
    ref = view.groups.get(name)
    return ref.label() if ref is not None else name


def _waiting_in(ctx: Context, rank: int, step: int) -> CollectiveEvent | None:
    """The rank's last collective, when it is of ``step`` and was not seen completing (where it waits)."""
    events = ctx.view.rank_events(rank)
    last = events[-1] if events else None
    return last if last is not None and last.step == step and last.completed is None else None


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind() or ctx.div is None or ctx.div.kind == DivergenceKind.P2P:
        return None
    div, view = ctx.div, ctx.view
    found = {r: x for r in sorted(ctx.present()) if (x := _reissued(ctx, r)) is not None}
    if not found:
        return None
    rank = next(iter(found))
    e, forward = found[rank]
    where = e.call_site.where if e.call_site else ""
    # The ranks that issued something else at this point (or nothing): those whose collective there is
    # not the same call site; ranks at the same re-issue with other shapes are a shape mismatch instead.
    others = [q for q in div.per_rank if not ((o := ctx.event(q)) is not None and _same_site(o, e))]
    if not others:
        return None
    reissuers = sorted(q for q in div.per_rank if q not in others)
    short = e.call_site.short if e.call_site else where

    evidence = []
    score = 0.35
    fwd_steps_of = {r: _steps_with(ctx, r, e, Phase.FORWARD) for r in div.per_rank}
    bwd_steps_of = {r: _steps_with(ctx, r, e, Phase.BACKWARD) for r in div.per_rank}
    evidence.append(
        f"at #{div.seq} of group {div.group.label()} {names(reissuers)} issued {e.op} {[list(s) for s in e.in_shapes]} "
        f"from {short} in backward (step {e.step}) after issuing it from the same call site in forward "
        f"{len(forward)} time{'s' if len(forward) != 1 else ''} in that step: the checkpoint's recompute "
        "issued the forward's collective again"
    )
    # The same code path run again: the re-issued stack repeats the forward's inner frames.
    fwd_stack = forward[-1].call_site.stack if forward[-1].call_site else ()
    prefix = _shared_prefix(e.call_site.stack if e.call_site else (), fwd_stack)
    in_dump = _recompute_in_dump(ctx, rank, e)
    proven = False
    if in_dump:
        score += 0.15
        proven = True
        evidence.append(
            f"rank {rank}'s stack shows torch.utils.checkpoint recomputing the region around {short} inside backward"
        )
    elif in_dump is None:
        evidence.append(f"not established: rank {rank} has no stack dump to show the checkpoint recompute")
    else:
        evidence.append(f"not established: rank {rank}'s stack shows no torch.utils.checkpoint frame under {short}")
    if prefix >= 2:
        score += 0.15
        proven = True
        evidence.append(
            f"its stack repeats the forward's {prefix} innermost frames of the job's code, out to "
            f"{_frame(fwd_stack[prefix - 1])} (the same path run again); forward reached it from "
            + (_frame(fwd_stack[prefix]) if len(fwd_stack) > prefix else "outside the job's code")
        )
    elif prefix == 1 and _outer_frames_from_forward(e.call_site.stack if e.call_site else (), fwd_stack):
        # The call site's function itself was checkpointed: in the recompute it was entered from torch
        # (autograd), so beyond it the stack holds only the training loop's frames that forward had too
        # (none on an autograd device thread), never a function of its own (an autograd Function's
        # backward calling a helper shared with forward code).
        score += 0.1
        proven = True
        evidence.append(
            f"beyond {short} its stack holds only frames of functions forward's stack had too (the training loop): "
            "the function was entered from autograd, not called by backward code"
        )
    elif not in_dump:
        evidence.append(
            "not established: the backward issue's caller differs from the forward's (a helper shared by forward "
            "and backward code looks alike)"
        )

    # What the others do instead: their collective at this sequence number, or, where they never
    # issued it, the collective they wait in on another group (a wait-for cycle across groups).
    theirs = {q: ctx.event(q) or _waiting_in(ctx, q, e.step) for q in others}
    fsdp = [q for q, t in theirs.items() if t is not None and t.module is not None and t.phase == Phase.BACKWARD]
    desc = "; ".join(
        f"rank {q}: "
        + (
            "nothing (it never issued this sequence number)"
            if t is None
            else ("" if t.group.name == e.group.name else "nothing here; it waits in ")
            + f"{t.op} {[list(s) for s in t.in_shapes]}"
            + ("" if t.group.name == e.group.name else f" #{t.seq} of group {_label(view, t.group.name)}")
            + f" in {phase_label(t.phase.value)}"
            + (f" of FSDP unit {t.module or '(root)'}" if t.module is not None else "")
            + (f" from {t.call_site.short}" if t.call_site else "")
        )
        for q, t in list(theirs.items())[:4]
    )
    evidence.append(f"there {names(others)} {verb(others, 'was', 'were')} at another collective: {desc}")
    if fsdp:
        score += 0.15
    elif any(t is not None and t.phase == Phase.BACKWARD for t in theirs.values()):
        score += 0.1
    else:
        score += 0.05

    agreed = [q for q in others if e.step in fwd_steps_of[q]]
    if agreed and len(agreed) == len(others):
        score += 0.1
        evidence.append(
            f"{names(others)} also issued it from {short} in forward of step {e.step}: the forward passes agreed, "
            "only the recompute differs"
        )
    earlier = [s for s in sorted(set(bwd_steps_of[rank]) - {e.step}) if all(s in bwd_steps_of[r] for r in div.per_rank)]
    if earlier:
        score += 0.1
        evidence.append(
            f"in step{'s' if len(earlier) > 1 else ''} {_steps(earlier)} every rank issued it in forward "
            f"(steps {_steps(fwd_steps_of[rank])} on rank {rank}) and again in backward: a re-issue that matched "
            f"until step {e.step}"
        )
    else:
        evidence.append(f"not established: no earlier step in which every rank re-issued {short} in backward")
    # Skipped, not reordered: a rank already reducing the gradients of an FSDP unit that the re-issuing
    # rank has not reduced yet in this step is past that unit's backward, recompute included: it will
    # not issue the collective later in this step (what tells this from an order inversion).
    reduced = {x.module for x in view.rank_events(rank) if x.step == e.step and x.op == "reduce_scatter"}
    passed = [
        q
        for q, t in theirs.items()
        if t is not None
        and t.op == "reduce_scatter"
        and t.module is not None
        and t.step == e.step
        and t.module not in reduced
    ]
    cap = 0.9
    if passed and len(passed) == len(others):
        cap = 0.97
        units = sorted({m for q in passed if (t := theirs[q]) is not None and (m := t.module) is not None})
        evidence.append(
            f"{names(passed)} already {verb(passed, 'reduces', 'reduce')} the gradients of FSDP unit "
            f"{', '.join(u or '(root)' for u in units)}, which rank {rank} has not reduced yet in step {e.step}: "
            f"{verb(passed, 'it is', 'they are')} past that unit's backward and will not issue the collective "
            "later in this step (skipped, not reordered)"
        )
    idle = [q for q, t in theirs.items() if t is None]
    if idle:
        # Nothing met it: those ranks wait in no collective (a straggler, a crash, a rank still in
        # forward code) and may yet issue it; that the recompute skipped it is not established.
        score = min(score, 0.35)
        evidence.append(
            f"not established: {names(idle)} {verb(idle, 'waits', 'wait')} in no collective: nothing shows "
            f"{verb(idle, 'it', 'they')} skipped the re-issued {e.op} rather than not reaching it yet"
        )
    if not proven:
        score = min(score, 0.35)
        evidence.append(
            f"score {score} instead of {cap}: neither the stack dump nor the call stacks show that the backward "
            "issue is the checkpoint's recompute"
        )
    culprits = tuple(others) if earlier and all(q in ctx.present() for q in others) else None
    suggestion = Suggestion(where, e.call_site.function if e.call_site else None, _ADVICE)
    # The fix reaches every checkpointed region by structure (no class or function of the job named).
    fix_config = {"recompute-cache-collective": {"regions": "checkpointed"}} if proven else None
    return Finding(
        round(min(score, cap), 3), tuple(evidence), culprits=culprits, suggestion=suggestion, fix_config=fix_config
    )


def _frame(frame: str) -> str:
    """``file:line function`` with the file's base name."""
    where, _, function = frame.partition(" ")
    return f"{where.rsplit('/', 1)[-1]} ({function})" if function else where.rsplit("/", 1)[-1]


def _steps(steps: list[int]) -> str:
    if len(steps) > 2 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


_ADVICE = (
    "Hoist this collective out of the activation-checkpointed region: issue it once before "
    "torch.utils.checkpoint.checkpoint(...) and pass its result into the checkpointed function (or cache it "
    "for the step), so the recompute in backward does not issue it again; a recompute that stops early or "
    "does not run on some ranks then cannot desync them."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------


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


RECOMPUTED_IN_BACKWARD = Requirement("a forward call site re-issued in backward (a recompute)", recomputed_in_backward)


DECLARATION = Declaration(
    "collective-in-checkpointed-region",
    DESYNC | SAME_POSITION | {M.RANK_OUTSIDE},
    (RECOMPUTED_IN_BACKWARD,),
    frozenset({"stack"}),
)

PATTERN = Pattern(
    id="collective-in-checkpointed-region",
    title="Collective re-issued by a checkpoint recompute",
    fixes=("recompute-cache-collective",),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
