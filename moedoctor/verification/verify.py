"""``verify``: rerun a job with fixes injected and prove them.

A verification passes only if every required check passes:

1. the job exits 0 by itself within the hang timeout;
2. the analysis of the rerun finds no divergence: every group's collective sequence is identical on
   all its ranks, and the coverage check found nothing missed;
3. each fix was applied (a target patched and called) on every rank, and its numerical check held
   on every rank (a check that could not run does not count as held);
4. where the original run recorded losses before it hung, the rerun's losses match them;
5. where the original run was slow, not stuck (its report's ``slow`` section: a storm of small
   collectives), no storm is left at those call sites (the time before and after is shown).

The change in step time (steps both runs completed) is reported, never judged.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from moedoctor.analysis import Report, Verdict, analyze, load_run
from moedoctor.errors import MoedoctorError
from moedoctor.fixes import get_fix
from moedoctor.fixes.config import write_fix_config
from moedoctor.fixes.rewrite import script_command
from moedoctor.layout import JOB_LOG, MANIFEST
from moedoctor.fixes.status import CheckStatus, FixStatus, read_fix_status
from moedoctor.analysis.report_json import write_json
from moedoctor.runner import Outcome, RunConfig, RunObserver, RunResult, run_job
from moedoctor.manifest_format import Key, Manifest, Status
from moedoctor.run_records import HangRecord
from moedoctor.runner.rundir import RunDir
from moedoctor.verification.numbers import (
    LossComparison,
    RunNumbers,
    StepTimeComparison,
    compare_losses,
    compare_step_times,
    read_numbers,
)


@dataclass(frozen=True)
class VerifyConfig:
    """What to verify: ``fixes`` on ``run`` (the rerun's ``RunConfig``, whose ``fixes`` field is set
    from here), against the original run (``load_original``; None: no before column)."""

    fixes: tuple[str, ...]
    run: RunConfig
    original: OriginalRun | None = None
    fix_config: dict = field(default_factory=dict)
    loss_rtol: float = 1e-4
    loss_atol: float = 1e-6


@dataclass(frozen=True)
class Check:
    """One row of the before/after table. ``passed`` None: not judged (``required`` False) or could
    not be established (``required`` True, which fails the verification)."""

    name: str
    passed: bool | None
    before: str
    after: str
    required: bool = True
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.passed is False or (self.required and self.passed is None)


@dataclass
class Verification:
    fixes: tuple[str, ...]
    command: list[str]
    run_dir: Path
    original: Path | None
    checks: list[Check]
    report: Report | None
    result: RunResult
    losses: LossComparison | None = None
    step_times: StepTimeComparison | None = None

    @property
    def passed(self) -> bool:
        return not any(c.failed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail or c.after}" for c in self.checks if c.failed]


@dataclass
class OriginalRun:
    """What the run being fixed recorded: its manifest, report and numbers."""

    path: Path
    command: list[str]
    manifest: Manifest
    report: dict | None
    numbers: RunNumbers

    @property
    def hang_timeout(self) -> float | None:
        hang = self.manifest.hang
        return hang.hang_timeout if hang else None


def load_original(path: Path) -> OriginalRun:
    """The run directory of the run to fix; ``MoedoctorError`` if it is not one."""
    layout = RunDir(Path(path))
    try:
        manifest = Manifest.read(layout.manifest)
    except FileNotFoundError:
        raise MoedoctorError(
            f"{path} is not a moedoctor run directory (no {MANIFEST}); give the job after -- instead"
        ) from None
    except (OSError, ValueError) as e:
        raise MoedoctorError(f"cannot read {layout.manifest}: {e}") from None
    command = manifest.command
    if not command:
        raise MoedoctorError(f"{layout.manifest} records no command to rerun")
    report = None
    if layout.report.exists():
        try:
            report = json.loads(layout.report.read_text())
        except (OSError, ValueError):
            report = None
    return OriginalRun(layout.path, [str(c) for c in command], manifest, report, read_numbers(layout.path))


def verify(config: VerifyConfig, observer: RunObserver | None = None) -> Verification:
    """Run ``config.run`` with the fixes and their checks injected; judge the rerun."""
    fixes = [get_fix(name) for name in config.fixes]
    original = config.original
    run_dir = Path(config.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fix_config_path = write_fix_config(run_dir, config.fix_config)
    branches = {
        os.path.normpath(section["branch"]["file"])
        for section in config.fix_config.values()
        if isinstance(section, dict) and isinstance(section.get("branch"), dict)
    }
    run = replace(
        config.run,
        fixes=tuple(f.name for f in fixes),
        fix_config=fix_config_path,
        fix_checks=True,
        command=script_command(list(config.run.command), branches) if branches else config.run.command,
    )
    started = time.monotonic()
    result = run_job(run, observer)
    elapsed = time.monotonic() - started
    if result.outcome == Outcome.INTERRUPTED:
        raise KeyboardInterrupt

    report = _analyze(run_dir)
    after = read_numbers(run_dir)
    checks = [_completion_check(result, elapsed, original), _sequence_check(report, result, original)]
    statuses = {fix.name: read_fix_status(run_dir, fix.name) for fix in fixes}
    for fix in fixes:
        checks += _fix_checks(fix.name, statuses[fix.name], report, result)
    slow = _slow_check(original, report, list(statuses.values()))
    if slow is not None:
        checks.insert(2, slow)
    losses = step_times = None
    if original is not None:
        losses = compare_losses(
            original.numbers, after, config.loss_rtol, config.loss_atol, upto_step=_divergence_step(original.report)
        )
        checks.append(_loss_check(losses, original.numbers))
        step_times = compare_step_times(original.numbers, after)
        checks.append(_step_time_check(step_times))
    return Verification(
        tuple(f.name for f in fixes),
        run.command,
        run_dir,
        original.path if original else None,
        checks,
        report,
        result,
        losses,
        step_times,
    )


def _analyze(run_dir: Path) -> Report | None:
    try:
        report = analyze(load_run(run_dir))
    except MoedoctorError:
        return None
    write_json(report, RunDir(run_dir).report)
    return report


# -- the checks -------------------------------------------------------------------------------------


def _original_outcome(original: OriginalRun | None) -> str:
    if original is None:
        return "-"
    m = original.manifest
    hang = m.hang
    if hang is not None:
        return _describe_hang(hang)
    if m.status == Status.INTERRUPTED:
        return "interrupted"
    failure = first_failure(m.ranks)
    if failure is not None:
        return failure
    return "finished" if m.status == Status.FINISHED else str(m.raw(Key.STATUS))


#: The signals a launcher sends the other ranks once one failed (torchrun: SIGTERM, then SIGKILL).
_TEARDOWN = (signal.SIGTERM, signal.SIGKILL)


def _how(code: int) -> str:
    """``SIGABRT (exit -6)``, ``exit 1``: how a process ended, from its status (a signal is negative)."""
    if code < 0:
        try:
            return f"{signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"signal {-code} (exit {code})"
    return f"exit {code}"


def first_failure(ranks: object) -> str | None:
    """Which rank failed first and how, from a manifest's ``ranks`` (``{rank: {exit_code, source}}``):
    the ranks that ended by themselves (an exit status of their own, or a signal other than the
    SIGTERM/SIGKILL a launcher sends the others once one failed), then those the launcher stopped.
    None where no rank failed."""
    if not isinstance(ranks, dict):
        return None
    failed: dict[int, int] = {}
    for key, entry in ranks.items():
        code = entry.get("exit_code") if isinstance(entry, dict) else None
        if isinstance(code, int) and not isinstance(code, bool) and code != 0 and str(key).isdigit():
            failed[int(key)] = code
    if not failed:
        return None
    stopped = sorted(r for r, c in failed.items() if c < 0 and -c in _TEARDOWN)
    own = sorted(r for r in failed if r not in stopped)
    if not own:  # every failed rank was signalled from outside: who failed first is not in the statuses
        return f"{_ranks(stopped)} stopped: " + ", ".join(_how(failed[r]) for r in stopped)
    first = f"{_ranks(own)} failed first: " + ", ".join(_how(failed[r]) for r in own)
    if len(own) > 1:
        first = f"{_ranks(own)} failed: " + ", ".join(f"rank {r} {_how(failed[r])}" for r in own)
    if stopped:
        first += f"; then {_ranks(stopped)} stopped by the launcher: " + ", ".join(_how(failed[r]) for r in stopped)
    return first


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _describe_hang(hang: HangRecord) -> str:
    if hang.trigger == "desync" and hang.finding:
        seconds = hang.detection_latency_s
        latency = f", {seconds:.1f} s after it was issued" if seconds is not None else ""
        return f"desync seen while running: {hang.finding}{latency}"
    return f"hang: no progress for {hang.idle_seconds:g} s (watchdog at {hang.hang_timeout:g} s)"


def _completion_check(result: RunResult, elapsed: float, original: OriginalRun | None) -> Check:
    before = _original_outcome(original)
    if result.outcome == Outcome.HANG:
        after = _describe_hang(result.hang) if result.hang else "hang"
        return Check("job completes", False, before, f"{after}; job stopped")
    if result.exit_code != 0:
        try:
            manifest = Manifest.read(result.run_dir.manifest)
        except (OSError, ValueError):
            manifest = None
        failure = first_failure(manifest.ranks) if manifest is not None else None
        how = f": {failure}" if failure else ""
        return Check("job completes", False, before, f"exit {result.exit_code} after {elapsed:.1f} s{how}")
    return Check("job completes", True, before, f"exit 0 in {elapsed:.1f} s")


def _describe_report(report: dict | Report | None) -> str:
    if report is None:
        return "-"
    if isinstance(report, Report):
        pattern, summary = report.pattern, report.summary
    else:
        pattern, summary = report.get("pattern"), report.get("summary", "")
    return f"{pattern}: {summary}" if pattern else summary


def _sequence_check(report: Report | None, result: RunResult, original: OriginalRun | None) -> Check:
    before = _describe_report(original.report) if original else "-"
    if report is None:
        return Check("identical collective sequences", None, before, "could not be analyzed (no traces)")
    if report.verdict != Verdict.HEALTHY:
        return Check("identical collective sequences", False, before, _describe_report(report))
    coverage = result.coverage
    if coverage is not None and not coverage.complete:
        return Check(
            "identical collective sequences",
            False,
            before,
            f"{report.collectives} collectives agree, but the coverage check found "
            f"{len(coverage.gaps)} gap(s): a missed collective cannot be ruled out",
        )
    ranks = ", ".join(map(str, report.traced_ranks))
    return Check(
        "identical collective sequences",
        True,
        before,
        f"identical on every rank ({report.collectives} collectives, ranks {ranks}); coverage complete",
    )


def _fix_checks(name: str, status: FixStatus, report: Report | None, result: RunResult) -> list[Check]:
    world = (report.world_size if report else None) or len(status.ranks)
    expected = set(range(world)) if world else set(status.ranks)
    applied = status.applied_ranks()
    notes = status.notes()
    if not status.ranks:
        applied_check = Check(
            f"{name} applied", False, "-", f"no rank reported it (was the fix installed? see {JOB_LOG})"
        )
    elif not applied:
        searched = status.searched()
        shown = ", ".join(searched[:3]) + (f" and {len(searched) - 3} more" if len(searched) > 3 else "")
        why = f"none of its {len(searched)} target(s) was found in the job (looked for {shown})"
        others = [n for n in notes if "did NOTHING" not in n]
        if others:
            why += "; " + "; ".join(others)
        applied_check = Check(f"{name} applied", False, "-", f"did not apply: {why}")
    elif set(applied) != expected:
        missing = sorted(expected - set(applied))
        applied_check = Check(
            f"{name} applied",
            False,
            "-",
            f"applied on ranks {applied} only; not on {missing}" + (f" ({'; '.join(notes)})" if notes else ""),
        )
    else:
        calls = ", ".join(f"{path.split(':')[-1]} x{n}" for path, n in status.calls().items() if n)
        applied_check = Check(
            f"{name} applied", True, "-", f"on all {len(applied)} ranks: {calls}", detail="; ".join(notes)
        )
    checks = [applied_check]
    by_name = status.checks()
    if not by_name:
        checks.append(Check(f"{name}: numerical check", None, "-", "never ran (the fix was not exercised on any rank)"))
    for check_name, per_rank in by_name.items():
        failed = [(r, c) for r, c in per_rank if c.passed is False]
        unknown = [(r, c) for r, c in per_rank if c.passed is None]
        ranks_ok = sorted(r for r, c in per_rank if c.passed)
        worst = max((c.worst for _, c in per_rank if c.worst is not None), default=None)
        worst_text = f"; largest difference {worst:.3g}" if worst is not None else ""
        if failed:
            rank, c = failed[0]
            checks.append(Check(f"{name}: {check_name}", False, "-", f"fails on rank {rank}: {c.detail}"))
        elif unknown or set(r for r, _ in per_rank) != expected:
            why = unknown[0][1].detail if unknown else f"ran on ranks {ranks_ok} only"
            checks.append(Check(f"{name}: {check_name}", None, "-", f"could not be established: {why}"))
        else:
            checks.append(
                Check(
                    f"{name}: {check_name}",
                    True,
                    "-",
                    f"holds on all {len(per_rank)} ranks: {_per_rank_details(per_rank)}{worst_text}",
                )
            )
    return checks


def _per_rank_details(per_rank: list[tuple[int, CheckStatus]]) -> str:
    """The check's detail, once if every rank says the same, else each rank's: what one rank compared
    (e.g. the forward with an idle expert) is not what every rank did."""
    ranks_by_detail: dict[str, list[int]] = {}
    for rank, c in per_rank:
        ranks_by_detail.setdefault(c.detail, []).append(rank)
    if len(ranks_by_detail) == 1:
        return per_rank[0][1].detail
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {detail}"
        for detail, ranks in ranks_by_detail.items()
    )


def _slow_check(original: OriginalRun | None, report: Report | None, statuses: list[FixStatus]) -> Check | None:
    """A job that was slow, not stuck: its storms of small collectives (the original report's
    ``slow`` section) must be gone from the rerun's records, and the time is shown before and after
    (the storm's time from the records; after, the fix's own timing of its target where it gives one)."""
    storms = (((original.report or {}).get("slow") or {}).get("storms") or []) if original else []
    if not storms:
        return None
    before = "; ".join(
        f"{s.get('count', 0):,} {s.get('op')}s from {str(s.get('call_site') or '?').rsplit('/', 1)[-1]} "
        f"in {float(s.get('seconds') or 0):.2f} s"
        for s in storms[:3]
    )
    if report is None:
        return Check("storm of small collectives", None, before, "could not be analyzed (no traces)")
    # The fix's own timing, per rank: "18,027 broadcasts in 1 coalesced broadcast(s), 0.31 s in the target".
    timing = [
        found
        for status in statuses
        for per_rank in status.checks().values()
        for _, c in per_rank
        if (
            found := re.search(
                r"([\d,]+ broadcasts in \d+ coalesced broadcast\(s\)), ([\d.]+) s in the target", c.detail or ""
            )
        )
    ]
    after_time = ""
    if timing:
        secs = sorted(float(t.group(2)) for t in timing)
        spread = f"{secs[0]:.2f} s" if secs[0] == secs[-1] else f"{secs[0]:.2f}-{secs[-1]:.2f} s over the ranks"
        after_time = f"; {spread} in the fix's target ({timing[0].group(1)})"
    sites = {(s.get("op"), s.get("call_site")) for s in storms}
    left = [s for s in (report.slow.storms if report.slow else []) if (s.op, s.call_site) in sites]
    if left:
        s = left[0]
        return Check(
            "storm of small collectives", False, before, f"still there: {s.count:,} {s.op}s in {s.seconds:.2f} s"
        )
    return Check("storm of small collectives", True, before, f"gone from the records{after_time}")


def _divergence_step(report: dict | None) -> int | None:
    """The step the original run's ranks parted in (the smallest of theirs at the divergence)."""
    per_rank = ((report or {}).get("divergence") or {}).get("per_rank") or {}
    steps = [op.get("step") for op in per_rank.values() if isinstance(op, dict)]
    steps = [s for s in steps if isinstance(s, int) and not isinstance(s, bool)]
    return min(steps) if steps else None


def _loss_check(losses: LossComparison, before: RunNumbers) -> Check:
    if losses.compared == 0:
        return Check("losses before the hang", None, "none recorded", "nothing to compare", required=False)
    ranks = sorted(before.losses)
    before_text = f"{losses.compared} losses (ranks {', '.join(map(str, ranks))})"
    if losses.passed:
        return Check(
            "losses before the hang",
            True,
            before_text,
            f"all {losses.compared} match (largest relative difference {losses.worst_relative:.2g})",
        )
    return Check(
        "losses before the hang",
        False,
        before_text,
        f"{losses.compared - losses.matched} of {losses.compared} differ: {losses.mismatches[0]}",
    )


def _step_time_check(times: StepTimeComparison) -> Check:
    if times.before is None or times.after is None:
        after = f"{times.after_all * 1e3:.1f} ms (median)" if times.after_all else "-"
        return Check("step time", None, "the original run completed too few steps", after, required=False)
    change = times.change
    steps = ", ".join(map(str, times.steps))
    return Check(
        "step time",
        None,
        f"{times.before * 1e3:.1f} ms (steps {steps})",
        f"{times.after * 1e3:.1f} ms ({change:+.1%}); all steps: {times.after_all * 1e3:.1f} ms",
        required=False,
    )
