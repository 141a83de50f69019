"""``uneven-dtensor-allgather``: ranks walk different key sets in a checkpoint save.

Mechanism: a save validates or gathers metadata per DTensor with ``all_gather_object`` (a size
all-gather plus a payload all-gather) on the shard group. When the ranks' state dicts hold
different keys (CPU-offloaded or hybrid optimizers keep no state for empty shards), they issue
different numbers of these collectives: one rank leaves the per-key loop and enters the next
collective of the save (``dcp.save``'s plan gather) while another is still in the loop.

Evidence: the divergence is in phase ``checkpoint_save`` on some rank; all-gather / gather ops;
during the save the ranks issued different numbers of collectives from the repeated per-key call
site before they parted; only some ranks logged ``checkpoint_save_begin`` (entered ``dcp.save``).

Risk: any desync during a save scores the phase points; the per-key count and the save-begin split
are what single this pattern out. Model-only saves (same keys everywhere) pass.

Fix ``key-manifest-checkpoint``: agree on one rank-invariant manifest of keys first (fixed-size
collectives), walk it in the same order everywhere, and take part with an empty shard for keys a
rank lacks.

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 6 variants of `uneven-dtensor-allgather/`
(EMA Stateful + DCP, hybrid offload optimizer, HSDP staging budget, state_dict post-hook, SwiGLU
split torch.save, TP export loop): 6/6 after the change. Confusions seen before it: per-key loops
whose phase is not a save (an export, a pre-save check) named `rank-conditional-collective`; a loop
exit on another group of a wait-for cycle named `collective-order-inversion`; and this pattern
claimed a rank-conditional DCP save from its checkpoint phase alone. The fix reaches 3 of the 6 by
structure (``fix_config``: the per-key ``if`` from the stacks, ``ctx.decision()``, or, when the key set
was filled earlier, the ``if`` that decided what went in, ``source.collection_decision``); the other
three fill their key sets through another function's return value or a ``state_dict()``.
"""

from __future__ import annotations

from collections import Counter

from moedoctor.analysis.evidence.requirements import CHECKPOINT_IO, GATHER_LOOP, any_of
from moedoctor.analysis.evidence.source import collection_decision
from moedoctor.analysis.evidence.steps import cycle_loop_exit, loop_exit
from moedoctor.analysis.mechanisms.loops import pass_restarted
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import (
    DESYNC,
    SAME_POSITION,
    SOURCE,
    Context,
    Declaration,
    Finding,
    Pattern,
    ev,
    names,
)
from moedoctor.events import Phase


_GATHERS = {"all_gather", "gather", "all_gather_coalesced", "broadcast"}


def _save_run(ctx: Context, rank: int) -> list:
    """The rank's collectives of the current save: the checkpoint-phase run up to the divergence."""
    events = ctx.view.events(rank, ctx.div.group.name, before=ctx.div.seq + 1)
    run = []
    for e in reversed(events):
        if e.phase != Phase.CHECKPOINT_SAVE:
            break
        run.append(e)
    return run[::-1]


def _walk_at_other_keys(ctx: Context, present: dict, saving: list[int]) -> str | None:
    """Every rank is in the save, at a gather from one call site with other sizes, and some rank issued
    that gather again in the save (a walk of one gather per key): the ranks gather different keys at
    the same position, one collective resized would not repeat."""
    if len(saving) != len(present) or len(present) < 2:
        return None
    if {v.op for v in present.values()} - set(_GATHERS) or len({v.call_site for v in present.values()}) != 1:
        return None
    if len({v.shapes for v in present.values()}) == 1:
        return None
    site = next(iter(present.values())).call_site
    div = ctx.div
    for r in sorted(present):
        again = [
            e
            for e in ctx.view.events(r, div.group.name)
            if e.seq > div.seq and e.phase == Phase.CHECKPOINT_SAVE and e.call_site and e.call_site.where == site
        ]
        before = [e for e in _save_run(ctx, r) if e.call_site and e.call_site.where == site and e.seq < div.seq]
        if again or before:
            short = site.rsplit("/", 1)[-1]
            sizes = "; ".join(f"rank {q}: {[list(x) for x in v.shapes]}" for q, v in present.items())
            return (
                f"every rank gathers from {short} in the save with other sizes ({sizes}), and rank {r} issued that "
                "gather more than once in it: a walk of one gather per key, the ranks at different keys"
            )
    return None


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind():
        return None
    div, view = ctx.div, ctx.view
    present = ctx.present()
    saving = sorted(r for r, v in present.items() if v.phase == "checkpoint_save")
    exit_ = loop_exit(view, div.group.name, div.seq, list(div.per_rank))
    if exit_ is not None and pass_restarted(view, div.group.name, div.seq, exit_) is not None:
        # Every earlier pass walked the same items and the "looping" ranks began the next pass: the
        # ranks walk the same number of items, they parted after the loop (mechanisms.loops).
        exit_ = None
    if exit_ is None and (looped := cycle_loop_exit(view, ctx.cycle)) is not None:
        exit_ = looped[1]
    if not saving and exit_ is None:
        return None
    score, evidence = 0.0, []
    if exit_ is not None:
        score += 0.45
        evidence.append(
            f"the ranks were looping over items with one collective each at {exit_.short}: "
            f"{names(exit_.left)} left the loop after "
            + ", ".join(f"{exit_.counts[r]}" for r in exit_.left)
            + f" while {names(exit_.looping)} issued "
            + ", ".join(f"{exit_.counts[r]}" for r in exit_.looping)
            + " so far: they walk different numbers of items (keys)"
        )
    if saving:
        score += 0.2
        evidence.append(
            f"the divergence at #{div.seq} of group {div.group.label()} is inside a checkpoint save "
            f"(phase checkpoint_save on {names(saving)})"
        )
    ops = {v.op for v in present.values()}
    if ops & _GATHERS:
        score += 0.15
        ops_text = ", ".join(f"rank {r}: {v.op} from {v.short_site}" for r, v in present.items())
        evidence.append(
            f"ops at the divergence: {ops_text} (all_gather_object issues a size all_gather, then a payload all_gather)"
        )
    runs = {r: _save_run(ctx, r) for r in div.per_rank}
    counts = {r: Counter(e.call_site.where for e in run if e.call_site) for r, run in runs.items()}
    total: Counter[str] = Counter()
    for c in counts.values():
        total.update(c)
    loop_site = None
    uneven_keys = False
    if total:
        loop_site = max(total, key=lambda s: (min(c.get(s, 0) for c in counts.values()), total[s], s))
        per_rank = {r: counts[r].get(loop_site, 0) for r in counts}
        if len(set(per_rank.values())) > 1 and min(per_rank.values()) > 0 and exit_ is None:
            uneven_keys = True
            score += 0.3
            short = loop_site.rsplit("/", 1)[-1]
            detail = ", ".join(f"rank {r}: {n}" for r, n in sorted(per_rank.items()))
            evidence.append(
                f"in this save the ranks issued different numbers of collectives from the per-key call "
                f"site {short} before they parted ({detail}): they walk different key sets"
            )
    begun = {
        r: bool([e for e in view.evidence(r, "checkpoint_save_begin") if runs[r] and e.time >= runs[r][0].time - 1.0])
        for r in div.per_rank
    }
    if any(begun.values()) and not all(begun.values()):
        score += 0.1
        entered = sorted(r for r, b in begun.items() if b)
        evidence.append(
            f"{names(entered)} entered the checkpoint writer (checkpoint_save_begin) while "
            f"{names(sorted(r for r, b in begun.items() if not b))} had not"
        )
    walked = _walk_at_other_keys(ctx, present, saving) if not uneven_keys and exit_ is None else None
    if walked is not None:
        uneven_keys = True
        score += 0.15
        evidence.append(walked)
    if not uneven_keys and exit_ is None and score > 0.35:
        evidence.append(
            f"score 0.35 instead of {score:.2f}: a desync inside a save, but no per-key call site whose "
            "collective count differs across ranks (the key sets are not shown to differ)"
        )
        score = 0.35
    suggestion = None
    if loop_site:
        fn = next(
            (
                e.call_site.function
                for run in runs.values()
                for e in run
                if e.call_site and e.call_site.where == loop_site
            ),
            None,
        )
        suggestion = Suggestion(loop_site, fn, _ADVICE)
    fix_config = None
    branch, filled = ctx.decision(), False
    if branch is None and loop_site:
        # Decided earlier, when the per-key collection was filled: no stack at the divergence shows it.
        branch = next((b for r in sorted(ctx.present()) if (b := collection_decision(ctx.stack(r))) is not None), None)
        filled = branch is not None
    if branch is not None and score >= 0.35:
        # Walk the same keys: an item is skipped only where every rank would skip it.
        agree = "any" if branch.runs_when else "all"
        if filled:
            evidence.append(
                f"the per-key loop walks a collection filled earlier; what went in was decided by "
                f"`if {branch.test}:` ({branch.short}), a rank-local test (an empty or pruned local "
                "shard): the ranks filled it with different keys"
            )
        elif exit_ is not None:
            # A rank that left the loop shows no stack inside it: the branch is a candidate, not seen taken.
            evidence.append(
                f"the per-key loop has a rank-local skip, `if {branch.test}:` ({branch.short}): a rank that "
                "took it on more keys leaves the loop with fewer collectives, as here, but no stack shows it "
                "taken; the ranks' key lists may differ instead (then the fix's check 'ranks disagreed and "
                "took one branch' stays unestablished and verify fails)"
            )
        else:
            evidence.append(
                f"the per-key decision is `if {branch.test}:` ({branch.short}): the ranks went different "
                "ways on the same key (a rank-local test: an empty or pruned local shard)"
            )
        fix_config = {
            "key-manifest-checkpoint": {
                "branch": {"file": branch.file, "line": branch.line, "agree": agree, "test": branch.test}
            }
        }
        suggestion = Suggestion(f"{branch.file}:{branch.line}", None, _ADVICE)
    return Finding(
        round(score, 3),
        tuple(evidence),
        suggestion=suggestion,
        fix_config=fix_config,
        culprits=exit_.left if exit_ is not None else None,
    )


_ADVICE = (
    "Agree on one rank-invariant key manifest before the per-key collectives (all_reduce MAX of its "
    "length, then all_gather of the padded manifests), walk it in the same order on every rank, and "
    "take part with an empty shard for keys this rank lacks."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------

DECLARATION = Declaration(
    "uneven-dtensor-allgather",
    DESYNC | SAME_POSITION | {M.RANK_OUTSIDE},
    (any_of(CHECKPOINT_IO, GATHER_LOOP),),
    ev("checkpoint_save_begin") | SOURCE,
)

PATTERN = Pattern(
    id="uneven-dtensor-allgather",
    title="Uneven DTensor all-gather in checkpoint save",
    fixes=("key-manifest-checkpoint",),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
