"""``inactive-experts``: experts without tokens leave FSDP2's gradient reductions uneven.

Mechanism: an MoE block loops only over experts that received tokens. An expert without tokens on
a rank gets no gradient there, so FSDP2 reduce-scatters a different set of gradients (a smaller
flat buffer for that unit) or fires that unit's post-backward hook late, in a different order; the
ranks' backward collectives no longer line up (Gloo aborts on the size mismatch, NCCL hangs).

Evidence: the divergence is in backward, on collectives issued from FSDP units' hooks
(``reduce_scatter`` / ``all_gather`` with ``mod`` set); the same unit reduce-scatters fewer elements
on some ranks (culprits: those ranks; every rank, when even the largest reduction is smaller than
the unit its all-gather gathered in that step: idle experts on every rank), or different units are
reduced at the same sequence number (culprits: the ranks that did not run, in the step's forward,
the unit the others reduce); ``params_without_grad`` names, on those ranks only, parameters of
members of a module list (``...experts.2.w1``: an indexed member, by the path's structure, not its
words); the model shards the members of a module list as separate FSDP units.

Risk: a genuinely non-deterministic bucket order also gives backward shape mismatches
(``shape-mismatch``); the same-unit smaller size and list members without gradients are what point
at routing. Any module list used sparsely (not only experts: a layer-drop list) reads alike.

Fix ``expert-dense``: run every expert every step (unrouted tokens weighted by zero) so the autograd
graph, and with it every FSDP collective, is the same on every rank. For MoE code of no class the
fixes know, ``expert-zero-term`` with ``lists: auto`` (written into the report's ``fix_config``): every
member of a module list runs once per forward of its owner, idle ones on empty inputs, in index order.

A second path, for gradients reduced one parameter at a time by the job's own loop (not FSDP):
every rank issues the divergent collective from one call site, ``params_without_grad`` at the end of
that step's backward names module-list members idle on some ranks only (culprits: those), and up to
the divergence their collectives from that call site are another rank's with exactly those
parameters' shapes left out (+0.1).

A third path, for a reducer with a fixed bucket layout (DDP without ``find_unused_parameters``): the
others wait in a backward gradient reduction that the culprits never issued, and the culprits'
``params_without_grad`` at the end of that backward names idle module-list members. DDP then raises
in the next forward; the finding ``explains_crash``, so the crash is named with this pattern.

A fourth path, in forward (one FSDP unit per expert, the block looping over the experts that got
tokens): aligned on the history every rank shares (``mechanisms.alignment.left_out``), some ranks skipped
collectives that are all of units that are indexed module-list members, where the others, as in
every earlier step, gather them (culprits: the skipping ranks).

Corpus (`benchmarks/diagnosis_accuracy.py`, Gloo): the 6 variants of `inactive-experts/` (FSDP2 per
block, per expert, HSDP, checkpointed MoE, DDP static buckets, hand-written c10d grad sync): 6/6.
Confusions seen: the hand-written per-parameter sync that skips None grads at its first iteration was
named `shape-mismatch` before the backward-end gradient evidence and the second path; the DDP job
whose reducer raises was a crash with no pattern before the third path. With the two
transformers 4.53.2 variants (OLMoE, Qwen2-MoE, recorded in `.venv-tf4`): 6/8 named, and the printed
verify passes on 5 of the 6 named (`expert-zero-term`, structural, on the four of custom code;
`olmoe_fsdp2_tf4` fails `expert-dense` because the job replaces `OlmoeSparseMoeBlock.forward` after
import, over the fix's patch).
"""

from __future__ import annotations

import re
from math import prod

from moedoctor.analysis.evidence.requirements import Requirement
from moedoctor.analysis.evidence.steps import loop_exit
from moedoctor.analysis.mechanisms.alignment import left_out
from moedoctor.analysis.mechanisms.vocabulary import Mechanism as M
from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns.base import DESYNC, SAME_POSITION, Context, Declaration, Finding, Pattern, ev, names
from moedoctor.events import Phase


_FSDP_BACKWARD_OPS = {"reduce_scatter", "all_gather", "all_reduce", "reduce_scatter_coalesced", "all_gather_coalesced"}


def _list_member(name: str) -> tuple[str, int] | None:
    """``("layers.0.mlp.experts", 2)`` for ``layers.0.mlp.experts.2.w1.weight``: the innermost indexed
    member of a module list in a parameter or unit path (None when the path has no index). Experts
    are such members: identical modules in a list, each run only for the tokens routed to it."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i])
    return None


def _sparse_members(names: set[str], others: list[set[str]]) -> set[tuple[str, int]]:
    """Module-list members with a parameter without gradient here that every other rank had one for."""
    seen_elsewhere = set().union(*others) if others else set()
    found = set()
    for n in names - seen_elsewhere:
        member = _list_member(n)
        if member is not None:
            found.add(member)
    return found


def classify(ctx: Context) -> Finding | None:
    if ctx.desync_kind() and ctx.div.kind.value == "missing":
        return _reduction_never_launched(ctx)
    if not ctx.desync_kind() or ctx.div.kind.value != "mismatch":
        return None
    div, view = ctx.div, ctx.view
    present = ctx.present()
    backward = {r: v for r, v in present.items() if v.phase == "backward"}
    if len(backward) < 2 or not any(v.op in _FSDP_BACKWARD_OPS for v in backward.values()):
        return _units_left_out(ctx) or _reduced_per_parameter(ctx)
    score = 0.35
    evidence = [
        f"the divergence at #{div.seq} of group {div.group.label()} is in backward: "
        + ", ".join(
            f"rank {r}: {v.op} {[list(s) for s in v.shapes]}" + (f" of FSDP unit {v.module}" if v.module else "")
            for r, v in backward.items()
        )
    ]
    culprits = None
    modules = {v.module for v in backward.values()}
    ops = {v.op for v in backward.values()}
    if len(modules) == 1 and None not in modules and len(ops) == 1:
        sizes = {r: v.numel for r, v in backward.items()}
        if len(set(sizes.values())) > 1:
            score += 0.3
            most = max(sizes.values())
            fewer = sorted(r for r, n in sizes.items() if n < most)
            culprits = tuple(fewer)
            evidence.append(
                f"FSDP unit {next(iter(modules))} {next(iter(ops))}s {most} elements on "
                f"{names(sorted(r for r, n in sizes.items() if n == most))} but "
                + ", ".join(f"{sizes[r]} on rank {r}" for r in fewer)
                + ": gradients of some of its parameters are missing there (parameters without gradients)"
            )
            # The unit's full size, from its all-gather in this step: a rank whose reduction is smaller
            # than that lacks gradients too, though fewer than the others (idle experts on every rank).
            unit, step = next(iter(modules)), min(v.step for v in backward.values())
            full = {
                r: {
                    sum(prod(s) for s in e.out_shapes)
                    for e in view.events(r, div.group.name, before=div.seq)
                    if e.module == unit and e.op == "all_gather" and e.step == step
                }
                for r in backward
            }
            whole = set.union(*full.values()) if full else set()
            if (
                next(iter(ops)) == "reduce_scatter"
                and len(whole) == 1
                and all(full.values())
                and most < (n_full := next(iter(whole)))
            ):
                culprits = tuple(sorted(backward))
                evidence.append(
                    f"its all_gather in step {step} gathered {n_full} elements on every rank: "
                    + ", ".join(f"rank {r} reduces {sizes[r]}" for r in sorted(sizes))
                    + ", every rank lacks gradients of some of its parameters"
                )
    elif len(modules) > 1 and None not in modules:
        score += 0.25
        evidence.append(
            "different FSDP units are reduced at the same sequence number: post-backward hooks fired "
            "in a different order across ranks"
        )
        # The rank that never ran, in this step's forward, a unit another rank is in: its router sent no
        # token there (the unit was skipped), which reordered the backward hooks.
        step = min(v.step for v in backward.values())
        ran = {
            r: {
                e.module
                for e in view.events(r, div.group.name, before=div.seq)
                if e.step == step and e.phase.value == "forward" and e.module
            }
            for r in backward
        }
        skipped = sorted(r for r in backward if any(v.module not in ran[r] for o, v in backward.items() if o != r))
        if skipped and len(skipped) < len(backward):
            culprits = tuple(skipped)
            evidence.append(
                f"{names(skipped)} did not run, in step {step}'s forward, the FSDP unit(s) "
                + ", ".join(sorted({v.module for o, v in backward.items() if o not in skipped}))
                + " that the other ranks reduce now"
            )
    without = {}
    for r in div.per_rank:
        names_: set[str] = set()
        for e in view.evidence(r, "params_without_grad"):
            params = e.data.get("params") or e.data.get("names") or []
            if isinstance(params, list):
                names_.update(p for p in params if isinstance(p, str))
        without[r] = names_
    if any(without.values()) and len({frozenset(v) for v in without.values()}) > 1:
        odd = sorted(
            r for r, v in without.items() if v and _sparse_members(v, [w for o, w in without.items() if o != r])
        )
        score += 0.25 if odd else 0.15
        r = (odd or sorted(r for r, v in without.items() if v))[0]
        sample = ", ".join(sorted(without[r])[:3])
        evidence.append(
            f"rank {r} had parameters without gradients at an optimizer step ({sample}"
            f"{', ...' if len(without[r]) > 3 else ''}) that other ranks had gradients for"
            + (": members of a module list that got no tokens" if odd else "")
        )
    units = {e.module for r in div.per_rank for e in view.events(r, div.group.name) if e.module}
    lists: dict[str, set[int]] = {}
    for u in units:
        member = _list_member(u)
        if member is not None:
            lists.setdefault(member[0], set()).add(member[1])
    per_member = sorted(prefix for prefix, idx in lists.items() if len(idx) > 1)
    if per_member:
        score += 0.05
        evidence.append(
            f"the model shards the members of a module list as separate FSDP units "
            f"({', '.join(f'{p}.0..{max(lists[p])}' for p in per_member[:3])}): each member is "
            "gathered and reduced only where it runs"
        )
    event = ctx.event(next(iter(backward)))
    suggestion = Suggestion(
        None if event is None or event.call_site is None else event.call_site.where,
        None if event is None or event.call_site is None else event.call_site.function,
        _ADVICE,
    )
    # For MoE code moedoctor has no block class for: expert-zero-term's structural mode (module lists).
    return Finding(
        round(score, 3),
        tuple(evidence),
        culprits=culprits,
        suggestion=suggestion,
        fix_config={"expert-zero-term": {"lists": "auto"}},
    )


def member_units_left_out(ctx: Context) -> dict[int, list[str]]:
    """Rank -> the FSDP units it left out, when aligning the ranks' streams on their shared history
    (``mechanisms.alignment.left_out``) shows some ranks skipping collectives that are all of sharded units that
    are indexed members of a module list (``moe.experts.0``): the members they did not run."""
    if ctx.div is None:
        return {}
    skipped = left_out(ctx.view, ctx.div.group.name, ctx.div.seq, sorted(ctx.present()))
    if not skipped:
        return {}
    units = {r: [e.module for e in events] for r, events in skipped.items()}
    if not all(u and all(m is not None and _list_member(m) is not None for m in u) for u in units.values()):
        return {}
    return {r: sorted({m for m in u if m is not None}) for r, u in units.items()}


def _units_left_out(ctx: Context) -> Finding | None:
    """A fourth path, in forward: FSDP units of module-list members (one unit per expert) that some
    ranks skipped where the others gather them (the loop runs only the experts that got tokens)."""
    units = member_units_left_out(ctx)
    if not units:
        return None
    culprits = tuple(sorted(units))
    r = culprits[0]
    v = ctx.present().get(r)
    evidence = (
        f"{names(list(culprits))} left out the collectives of FSDP unit(s) {', '.join(units[r][:4])} at "
        f"#{ctx.div.seq} of group {ctx.div.group.label()}, where the other ranks, as in every earlier step, "
        "issue them: members of a module list that did not run there (no tokens routed to them)",
    )
    return Finding(
        0.7,
        evidence,
        culprits=culprits,
        suggestion=Suggestion(None if v is None else v.call_site, None if v is None else v.function, _ADVICE),
        fix_config={"expert-zero-term": {"lists": "auto"}},
    )


def _missing_at(view, rank: int, step: int) -> dict[str, tuple[int, ...]]:
    """The rank's parameters without a gradient as of ``step`` (the set is written when it changes):
    name -> local shape."""
    found: dict[str, tuple[int, ...]] = {}
    for e in view.evidence(rank, "params_without_grad"):
        if e.step is not None and e.step > step:
            break
        names, shapes = e.data.get("names") or [], e.data.get("shapes") or []
        found = {
            n: tuple(shapes[i]) if i < len(shapes) and isinstance(shapes[i], list) else ()
            for i, n in enumerate(names)
            if isinstance(n, str)
        }
    return found


def _backward_raised(view, rank: int, step: int) -> bool:
    """The rank's backward of ``step`` raised: its ``backward_end`` says so, or the rank's uncaught
    exception was raised in backward of that step."""
    if any(e.data.get("raised") for e in view.evidence(rank, "backward_end", step)):
        return True
    exc = view.exception(rank)
    return exc is not None and exc.phase == Phase.BACKWARD and exc.step == step


def _skips_only(ref: list[tuple], mine: list[tuple], skippable: list[tuple]) -> int | None:
    """How many of ``ref``'s items ``mine`` leaves out, where ``mine`` is ``ref`` with only items of
    the ``skippable`` shapes (each used once) left out; None when it is not."""
    pool = list(skippable)
    i = j = skipped = 0
    while i < len(ref) and j < len(mine):
        if ref[i] == mine[j]:
            i, j = i + 1, j + 1
        elif ref[i] in pool:
            pool.remove(ref[i])
            i, skipped = i + 1, skipped + 1
        else:
            return None
    return skipped if skipped and (i == len(ref) or j == len(mine)) else None


def _idle_members(missing: dict[int, dict[str, tuple[int, ...]]]) -> dict[int, list[str]]:
    """Per rank, its parameters without a gradient that belong to module-list members and that some
    other rank had a gradient for."""
    everywhere = set.intersection(*(set(m) for m in missing.values())) if missing else set()
    return {r: sorted(n for n in m if n not in everywhere and _list_member(n) is not None) for r, m in missing.items()}


def _reduction_never_launched(ctx: Context) -> Finding | None:
    """The others wait in a gradient reduction of backward that the missing ranks never issued, and
    those ranks' backward of that step left module-list members without gradients that the waiting
    ranks had: a reducer with a fixed bucket layout (DDP without ``find_unused_parameters``) never
    launches the bucket with the idle member's gradients. DDP then raises in the next forward, so the
    rank dies: the finding explains the crash."""
    div, view = ctx.div, ctx.view
    present = ctx.present()
    if not present or not div.missing or any(v.phase != "backward" for v in present.values()):
        return None
    step = min(v.step for v in present.values())
    if any(_backward_raised(view, r, step) for r in div.missing):
        # A backward that raised (a recompute's CheckpointError) leaves parameters without gradients
        # where autograd stopped: that says nothing about routing (traces from before the recorder
        # stopped checking then still hold such a set).
        return None
    missing = {r: _missing_at(view, r, step) for r in (*present, *div.missing)}
    idle = _idle_members(missing)
    if not all(idle[r] for r in div.missing) or any(idle[r] for r in present):
        return None
    params = sorted({n for r in div.missing for n in idle[r]})
    v = next(iter(present.values()))
    evidence = [
        f"{names(sorted(present))} wait{'s' if len(present) == 1 else ''} in {v.op} #{div.seq} of group "
        f"{div.group.label()}, a gradient reduction issued in step {step}'s backward ({v.short_site}), "
        f"that {names(div.missing)} never issued",
        f"{names(div.missing)} had no gradient, at the end of that backward, for "
        f"{', '.join(params[:4])}{f' and {len(params) - 4} more' if len(params) > 4 else ''} (parameters "
        f"of members of a module list) that {names(sorted(present))} had gradients for: those members "
        "got no token there, and the reduction that carries their gradients was never launched",
    ]
    suggestion = Suggestion(v.call_site, v.function, _ADVICE)
    return Finding(
        0.6,
        tuple(evidence),
        culprits=tuple(div.missing),
        suggestion=suggestion,
        fix_config={"expert-zero-term": {"lists": "auto"}},
        explains_crash=True,
    )


def _reduced_per_parameter(ctx: Context) -> Finding | None:
    """Gradients reduced one parameter at a time by the job's own loop (or a reducer it drives), which
    skips parameters without a gradient: the ranks where a module-list member got no token issue that
    loop's collectives minus the member's parameters, and the rest pair with the wrong tensors."""
    div, view = ctx.div, ctx.view
    present = ctx.present()
    sites = {v.call_site for v in present.values()}
    if len(present) < 2 or None in sites:
        return None
    left = None
    if len(sites) != 1:
        # The ranks that skipped parameters may have run out of the loop already: a loop of the
        # reduction's call site that exactly those ranks left after fewer iterations.
        exit_ = loop_exit(view, div.group.name, div.seq, list(div.per_rank))
        if exit_ is None:
            return None
        sites, left = {exit_.site}, sorted(exit_.left)
    site = next(iter(sites))
    step = min(v.step for v in present.values())
    missing = {r: _missing_at(view, r, step) for r in present}
    idle = _idle_members(missing)
    odd = sorted(r for r, members in idle.items() if members)
    kept = sorted(r for r in present if r not in odd)
    if not odd or not kept or (left is not None and left != odd):
        return None
    group = div.group.name

    def shapes(rank: int) -> list[tuple]:
        return [
            e.in_shapes
            for e in view.events(rank, group)
            if e.step == step and e.seq <= div.seq and e.call_site is not None and e.call_site.where == site
        ]

    ref = shapes(kept[0])
    skipped = {r: _skips_only(ref, shapes(r), [(missing[r][n],) for n in idle[r]]) for r in odd}
    params = sorted({n for r in odd for n in idle[r]})
    score = 0.6
    evidence = [
        f"{names(odd)} had no gradient, at the end of step {step}'s backward, for "
        f"{', '.join(params[:4])}{f' and {len(params) - 4} more' if len(params) > 4 else ''} (parameters "
        f"of members of a module list) that {names(kept)} had gradients for: those members got no token",
        f"every rank issued #{div.seq} of group {div.group.label()} from the same call site "
        f"({site.rsplit('/', 1)[-1]}), one collective per parameter with a gradient"
        if left is None
        else f"{names(odd)} left the loop at {site.rsplit('/', 1)[-1]} (one collective per parameter with a "
        f"gradient) after fewer iterations than {names(kept)}, by #{div.seq} of group {div.group.label()}",
    ]
    if all(n is not None for n in skipped.values()):
        score += 0.1
        evidence.append(
            f"up to #{div.seq}, {names(odd)} issued from there {names(kept[:1])}'s collectives of "
            f"step {step} with collectives of those parameters' shapes left out: the loop skipped "
            "them, and the collectives after them pair with other parameters"
        )
    event = ctx.event(odd[0])
    suggestion = Suggestion(
        site, None if event is None or event.call_site is None else event.call_site.function, _ADVICE
    )
    return Finding(
        round(score, 3),
        tuple(evidence),
        culprits=tuple(odd),
        suggestion=suggestion,
        fix_config={"expert-zero-term": {"lists": "auto"}},
    )


_ADVICE = (
    "Make every expert take part every step: run all experts on all tokens with zero routing weight for "
    "unrouted ones (or add a zero-weighted term over every expert parameter), so every rank has the same "
    "gradients and FSDP2 reduces the same buffers in the same order. Check the output matches the sparse path."
)

# ---- what it refines, the evidence it requires and what its classifier reads ---------------------

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
    if member_units_left_out(ctx):
        return True
    for r in ctx.div.per_rank:
        for e in ctx.view.evidence(r, "params_without_grad"):
            names = e.data.get("params") or e.data.get("names") or {}
            if any(_MEMBER.search(str(n)) for n in names):
                return True
    return False


EXPERTS_WITHOUT_GRADIENTS = Requirement(
    "module-list members (experts) without gradients on some rank", experts_without_gradients
)


DECLARATION = Declaration(
    "inactive-experts",
    DESYNC | SAME_POSITION | {M.RANK_OUTSIDE},
    (EXPERTS_WITHOUT_GRADIENTS,),
    ev("params_without_grad", "backward_begin", "backward_end") | {"exception"},
)

PATTERN = Pattern(
    id="inactive-experts",
    title="Inactive experts (MoE gradients missing on some ranks)",
    fixes=("expert-dense", "expert-zero-term"),
    desync=True,
    classify=classify,
    advice=_ADVICE,
)
