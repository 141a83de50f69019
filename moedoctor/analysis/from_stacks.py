"""A ``Report`` from the ranks' stacks alone: what ``moedoctor triage`` says about a job that left
no traces (started with plain ``torchrun``, no Flight Recorder dump).

One py-spy dump per rank, taken while the job hangs. The ranks are grouped by identical main-thread
stack (each frame as file:function, line numbers kept for the job's own code only, so two ranks
blocked in the same collective from the same line match however torch's internals moved), and each
class is described by the collective it waits in (the innermost ``torch.distributed`` frame, with
the API the job called, e.g. ``all_gather_object -> all_gather``) and its innermost own frame.

What the stacks prove, and what they do not:

- some ranks inside a collective, others outside any: a **straggler** (the ranks outside are where
  the others wait for them); a rank that skipped a collective and then blocked in its own code looks
  the same, and the stack names the function, which tells them apart;
- ranks inside **different** collectives (or the same one from different call sites): a **code
  desync**; which known pattern it is needs the sequence of collectives (traces or Flight Recorder);
- every rank inside the same collective from the same line: stuck in one collective; shapes are not
  in a stack, so a hardware or network fault or a peer on another node cannot be told apart from
  here, and no pattern is named;
- no rank inside a collective: not a collective hang (the job computes, or is stuck in its own code).

Before any of these: a rank whose process does not run (state ``T``/``t``: stopped, ``D``:
uninterruptible, in every reading of ``/proc`` around its dump) is named ``rank-stopped``, wherever
its stack is: the others wait for it, and ranks in different collectives prove no desync when one of
them cannot move (it may be inside a collective the others already left).

One snapshot: a healthy job caught inside a collective looks stuck; run triage again to compare.
Nothing here imports torch, prints or exits.
"""

from __future__ import annotations

from dataclasses import dataclass

from moedoctor.analysis.patterns import admits
from moedoctor.analysis.loading.run_data import GpuSnapshot
from moedoctor.analysis.mechanisms.detection import mechanism_from_stacks
from moedoctor.analysis.model import RankSummary, Report, Verdict
from moedoctor.analysis import patterns
from moedoctor.analysis.patterns.base import StackContext, names
from moedoctor.process_state import FROZEN_STATES
from moedoctor.analysis.evidence.stack_reading import RankStack, read_rank_stack
from moedoctor.run_records import StackDump

SOURCE_KIND = "stacks"


@dataclass(frozen=True, slots=True)
class StackClass:
    """Ranks whose main threads show the same stack."""

    ranks: tuple[int, ...]
    stack: RankStack

    def describe(self) -> str:
        who = names(self.ranks)
        s = self.stack
        if s.collective is None:
            return f"{who}: in {s.where()}, outside any collective"
        return f"{who}: {'waits' if len(self.ranks) == 1 else 'wait'} in {s.waits_in}, called from {s.where()}"


def classify_stacks(stacks: dict[int, StackDump]) -> list[StackClass]:
    """Ranks grouped by identical normalized main-thread stack, largest class first (ties: lowest rank)."""
    by_key: dict[tuple[str, ...], list[RankStack]] = {}
    for rank in sorted(stacks):
        s = read_rank_stack(stacks[rank])
        if s is not None:
            by_key.setdefault(s.key, []).append(s)
    classes = [StackClass(tuple(s.rank for s in group), group[0]) for group in by_key.values()]
    return sorted(classes, key=lambda c: (-len(c.ranks), c.ranks[0]))


def report_from_stacks(
    stacks: dict[int, StackDump],
    *,
    source: str,
    world_size: int | None = None,
    gpus: list[GpuSnapshot] | None = None,
    states: dict[int, str] | None = None,
    incomplete: list[str] | None = None,
) -> Report:
    """The verdict the stacks allow, as a ``Report`` the usual renderers print.

    ``states`` maps a rank to its process state letter (``/proc/PID/stat``); ``world_size`` the
    job's, to say when ranks of other nodes were not seen."""
    states = states or {}
    incomplete = list(incomplete or [])
    classes = classify_stacks(stacks)
    read = sorted(r for c in classes for r in c.ranks)
    for rank, dump in sorted(stacks.items()):
        if rank not in read:
            incomplete.append(f"rank {rank}: no stack ({dump.error or 'py-spy showed no main thread'})")
    if world_size and len(read) < world_size:
        absent = sorted(set(range(world_size)) - set(read))
        incomplete.append(
            f"no stack of {names(absent)} (of world size {world_size}): on another node, or "
            "unreadable; run moedoctor triage on each node"
        )
    letters = _frozen(stacks, states)
    frozen = {r: FROZEN_STATES[letter] for r, letter in letters.items()}
    evidence = [c.describe() + (f" [{len(c.ranks)} of {len(read)} ranks]" if len(classes) > 1 else "") for c in classes]
    evidence.extend(f"rank {r}'s process is {why}" for r, why in frozen.items())
    evidence.extend(_gpu_lines(gpus or []))

    inside = [c for c in classes if c.stack.collective is not None]
    outside = [c for c in classes if c.stack.collective is None]
    pattern = None
    culprits: list[int] = []
    reasoning = "the stacks do not single out a rank"
    suggestion = None
    mechanism = mechanism_from_stacks(inside, outside, frozen)
    found = (
        None
        if not classes and not frozen
        else patterns.from_stacks(StackContext(stacks, inside, outside, frozen, letters))
    )
    if found is not None and mechanism is not None and not admits(found[0].id, mechanism):
        found = None  # the pattern does not refine what the stacks show: the mechanism is the diagnosis
    if found is not None:
        pattern, finding = found
        verdict = Verdict.DESYNC if pattern.desync else Verdict.STUCK
        summary, culprits, reasoning, suggestion = (
            finding.summary,
            finding.culprits,
            finding.reasoning,
            finding.suggestion,
        )
    elif not classes:
        verdict = Verdict.STUCK
        summary = "No rank's stack could be read: nothing to conclude (see Incomplete data)."
    elif not inside:
        verdict = Verdict.HEALTHY
        summary = (
            f"No rank waits in a collective: {names(read)} {'is' if len(read) == 1 else 'are'} in the job's "
            "own code, so this is not a collective hang (if the job makes no progress, the stacks show "
            "where it is stuck)."
        )
        reasoning = "no rank waits in a collective"
    else:
        verdict = Verdict.STUCK
        s = inside[0].stack
        whom = names(read) if len(read) > 1 else f"the only rank seen ({names(read)})"
        summary = (
            f"Stuck in one collective: {whom} {'waits' if len(read) == 1 else 'wait'} in {s.waits_in} from "
            f"{s.where()}. Not a code desync between these ranks: suspect the hardware or network, or a "
            "peer elsewhere"
            + (" (another node)" if world_size and len(read) < world_size else "")
            + " (the stacks alone do not show shapes or completion: run the job under moedoctor run to tell)."
        )
    return Report(
        source=source,
        source_kind=SOURCE_KIND,
        verdict=verdict,
        summary=summary,
        pattern=pattern.id if pattern else None,
        pattern_title=pattern.title if pattern else None,
        culprit_ranks=culprits,
        culprit_reasoning=reasoning,
        divergence=None,
        wait_for=[],
        cycle=None,
        evidence=evidence,
        candidates=[],
        fixes=[],
        verify_command=None,
        suggestion=suggestion,
        groups=[],
        ranks=_summaries(stacks),
        alignment=[],
        alignment_ranks=[],
        incomplete=incomplete,
        world_size=world_size,
        traced_ranks=[],
        collectives=0,
        mechanism=mechanism,
    )


def _frozen(stacks: dict[int, StackDump], states: dict[int, str]) -> dict[int, str]:
    """Ranks whose process does not run, with their state letter: from the readings recorded with
    each dump (several, around it), else from the one state letter the caller read."""
    found = {}
    for rank in sorted(set(stacks) | set(states)):
        dump = stacks.get(rank)
        if dump is not None and dump.process is not None:
            letter = dump.process.frozen
        else:
            letter = states.get(rank) if states.get(rank) in FROZEN_STATES else None
        if letter:
            found[rank] = letter
    return found


# ---- reading a stack ----------------------------------------------------------------------------


def _gpu_lines(gpus: list[GpuSnapshot]) -> list[str]:
    out = []
    for snap in gpus:
        if not snap.available:
            out.append(f"no GPU state for host {snap.host}: {snap.reason}")
            continue
        bad = [f"GPU {d.index}: {d.ecc_uncorrected} uncorrected ECC errors" for d in snap.devices if d.ecc_uncorrected]
        bad += [f"GPU {d.index}: row remapping failed" for d in snap.devices if d.remapped_failure]
        fine = f"no GPU errors on {len(snap.devices)} GPU(s)"
        out.append(f"NVML on {snap.host}: " + ("; ".join(bad) if bad else fine))
    return out


def _summaries(stacks: dict[int, StackDump]) -> list[RankSummary]:
    out = []
    for rank, dump in sorted(stacks.items()):
        s = read_rank_stack(dump)
        state = None if dump.process is None else dump.process.summary
        if s is None:
            stack = f"unavailable: {dump.error.split('. ')[0]}" if dump.error else None
            out.append(RankSummary(rank, None, None, False, stack, None, None, None, state))
            continue
        where = s.where() if s.user_frame else str(dump.main_thread[0])
        out.append(
            RankSummary(
                rank,
                None,
                None,
                s.collective is not None,
                f"{s.waits_in} <- {where}" if s.collective else where,
                s.collective is not None,
                None,
                None,
                state,
            )
        )
    return out


__all__ = ["RankStack", "StackClass", "classify_stacks", "read_rank_stack", "report_from_stacks", "SOURCE_KIND"]
