"""The numbers ``moedoctor verify`` compares between the original run and the rerun, read from the
traces' evidence records (no torch): each rank's losses (the scalar every backward started from,
keyed by the backward's ordinal on that rank) and when each optimizer step ended."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.layout import RunDir
from moedoctor.trace.reader import TraceError, read_traces


@dataclass
class RunNumbers:
    losses: dict[int, dict[int, float]] = field(default_factory=dict)  # rank -> backward ordinal -> loss
    step_ends: dict[int, dict[int, float]] = field(default_factory=dict)  # rank -> step -> wall time
    loss_steps: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> backward ordinal -> step
    problems: list[str] = field(default_factory=list)

    def step_times(self) -> dict[int, float]:
        """Step -> duration in seconds (end of step s minus end of step s-1, slowest rank)."""
        durations: dict[int, float] = {}
        for ends in self.step_ends.values():
            for step, end in ends.items():
                if step - 1 in ends:
                    durations[step] = max(durations.get(step, 0.0), end - ends[step - 1])
        return durations

    @property
    def loss_count(self) -> int:
        return sum(len(v) for v in self.losses.values())


def read_numbers(run_dir: Path) -> RunNumbers:
    numbers = RunNumbers()
    traces_dir = RunDir(Path(run_dir)).traces
    if not traces_dir.is_dir():
        numbers.problems.append(f"no traces in {run_dir}")
        return numbers
    try:
        traces = read_traces(traces_dir)
    except TraceError as e:
        numbers.problems.append(str(e))
        return numbers
    for trace in traces:
        losses = numbers.losses.setdefault(trace.rank, {})
        ends = numbers.step_ends.setdefault(trace.rank, {})
        steps = numbers.loss_steps.setdefault(trace.rank, {})
        for ev in trace.evidence:
            if ev.kind == "loss":
                losses[int(ev.data["index"])] = float(ev.data["value"])  # "inf" / "nan" are written as strings
                steps[int(ev.data["index"])] = ev.step
            elif ev.kind == "optimizer_step_end" and ev.step > 0:
                ends[ev.step] = max(ends.get(ev.step, ev.time), ev.time)
    return numbers


@dataclass(frozen=True)
class LossComparison:
    compared: int
    matched: int
    worst_relative: float  # largest |after - before| / max(|before|, tiny) over compared losses
    mismatches: tuple[str, ...]  # "rank 1 loss #2: 2.310000 vs 2.410000"

    @property
    def passed(self) -> bool:
        return self.compared > 0 and self.matched == self.compared


def compare_losses(
    before: RunNumbers, after: RunNumbers, rtol: float = 1e-4, atol: float = 1e-6, upto_step: int | None = None
) -> LossComparison:
    """Every loss the original run recorded before step ``upto_step``, the step its ranks diverged in
    (from that step on, the original's numbers come from ranks that no longer ran the same program:
    some stepped where others skipped, or a collective was silently paired with another rank's
    different one, as Gloo does with equal-size all-gathers of different FSDP units), against the
    rerun's loss of the same rank and ordinal."""
    compared = matched = 0
    worst = 0.0
    mismatches: list[str] = []
    for rank, losses in sorted(before.losses.items()):
        rerun = after.losses.get(rank, {})
        for index, value in sorted(losses.items()):
            if upto_step is not None and before.loss_steps.get(rank, {}).get(index, 0) >= upto_step:
                continue
            compared += 1
            other = rerun.get(index)
            if other is None:
                mismatches.append(f"rank {rank} loss #{index}: {value:.6g} vs nothing (the rerun stopped earlier)")
                continue
            same = (math.isnan(value) and math.isnan(other)) or math.isclose(other, value, rel_tol=rtol, abs_tol=atol)
            if math.isfinite(value) and math.isfinite(other):
                worst = max(worst, abs(other - value) / max(abs(value), 1e-12))
            if same:
                matched += 1
            else:
                mismatches.append(f"rank {rank} loss #{index}: {value:.8g} vs {other:.8g}")
    return LossComparison(compared, matched, worst, tuple(mismatches))


@dataclass(frozen=True)
class StepTimeComparison:
    steps: tuple[int, ...]  # the steps both runs completed (step 0 is warm-up: never counted)
    before: float | None  # median seconds over ``steps``
    after: float | None
    after_all: float | None  # the rerun's median over all its steps

    @property
    def change(self) -> float | None:
        if not self.before or self.after is None:
            return None
        return self.after / self.before - 1.0


def compare_step_times(before: RunNumbers, after: RunNumbers) -> StepTimeComparison:
    b, a = before.step_times(), after.step_times()
    common = tuple(sorted(set(b) & set(a)))
    return StepTimeComparison(
        steps=common,
        before=statistics.median(b[s] for s in common) if common else None,
        after=statistics.median(a[s] for s in common) if common else None,
        after_all=statistics.median(a.values()) if a else None,
    )
