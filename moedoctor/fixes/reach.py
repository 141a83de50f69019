"""Can the named fix reach this job's code? Checked before ``moedoctor verify`` is offered.

A fix patches named functions or classes (its targets, or those given with ``--config``). The
recorder wrote the job's own frames for every collective (``file:line function``) and py-spy the
stacks of a hang; a target whose module file and function appear there is code this job ran. When
no target of the fix appears, a verify rerun would only say "did not apply": the report says so at
once, names the targets, and points at the call site to change (or at ``--config``).

Frames do not carry class names, so a ``Class.method`` target matches on its module file and method
name; a module run as the script (``__main__``) matches the script of the job's command. A function
that issues no collective itself is never on a recorded stack: a target counts as reached when any
frame of its module (other than the script) was seen, so the note errs towards offering verify.
A fix the report already points at the job's own code (``Report.fix_config``: the ``if`` that made
the decision, found by the analysis) reaches it by construction.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from moedoctor.analysis.loading.run_data import RunData
from moedoctor.analysis.model import Report
from moedoctor.analysis.evidence.source import assigns_attribute, defined_classes, frames, overrides_method
from moedoctor.fixes import FIXES


def script_of(command: list[str] | None) -> str | None:
    """The Python script a launch command runs (the first ``*.py`` argument)."""
    for arg in command or ():
        if arg.endswith(".py"):
            return os.path.normpath(arg)  # as written: relative to the job's directory, not to ours
    return None


def run_frames(run: RunData) -> set[tuple[str, str]]:
    """``(file, function)`` of every job frame the traces and stacks hold: collectives' call sites, the
    frames of uncaught exceptions and the function ``torch.utils.checkpoint`` was running then, and
    py-spy's stacks."""
    found: set[tuple[str, str]] = set()
    for trace in run.traces:
        for event in trace.events:
            if event.call_site is not None:
                found.add((event.call_site.file, event.call_site.function))
                found.update((f.file, f.function) for f in frames(event.call_site.stack))
        for exc in trace.exceptions:
            found.update((f.file, f.function) for f in exc.frames)
            if exc.checkpointed is not None:  # the checkpointed forward, recomputed when the error was raised
                found.add((exc.checkpointed.file, exc.checkpointed.function.rpartition(".")[2]))
    for dump in run.stacks.values():
        for thread in (dump.main_thread, *dump.threads.values()):
            found.update((frame.file, frame.function) for frame in thread)
    return found


def _module_file_matches(module: str, file: str, script: str | None) -> bool:
    if module == "__main__":
        if script is None:
            return False
        file = os.path.normpath(file)
        return file == script if os.path.isabs(script) else (file == script or file.endswith(os.sep + script))
    stem = module.replace(".", os.sep)
    return file.endswith(stem + ".py") or file.endswith(os.path.join(stem, "__init__.py"))


def reached(paths: Iterable[str], seen: set[tuple[str, str]], script: str | None) -> list[str]:
    """The target paths (``module:Qual.name``) this job may have run. A method (``Class.method``) is
    reached when a frame of its module was seen and the module's source defines that class (a block's
    forward is often not on any collective's stack, but its module is; the same module path in another
    library version may lack the class).
    A function is reached when it was seen in its module, or (a function that issues no collective
    itself, such as a decision helper, is never on a collective's stack) when any frame of its module
    was, unless the module is the script itself."""
    found = []
    for path in paths:
        module, _, qualname = path.partition(":")
        owner, _, function = qualname.rpartition(".")
        files = [(file, fn) for file, fn in seen if _module_file_matches(module, file, script)]
        if owner:
            if any(_defines(file, owner) for file in {f for f, _ in files}):
                found.append(path)
        elif any(fn == function for _, fn in files) or (files and module != "__main__"):
            found.append(path)
    return found


def _replaced_by_job(path: str, seen: set[tuple[str, str]]) -> bool:
    """Does the job's own code (not an installed package) assign ``Class.method`` of the target, or
    subclass the class with its own ``method`` that never calls the base's?"""
    owner, _, method = path.partition(":")[2].rpartition(".")
    if not owner:
        return False
    name = owner.rsplit(".", 1)[-1]
    files = {f for f, _ in seen if "-packages" + os.sep not in f and os.sep + "moedoctor" + os.sep not in f}
    return any(
        assigns_attribute(f, name, method) is not None or overrides_method(f, name, method) is not None
        for f in sorted(files)
    )


def _defines(file: str, owner: str) -> bool:
    """Does the module's source define the target's class (True where the source cannot be read)?"""
    classes = defined_classes(file)
    return owner.rsplit(".", 1)[-1] in classes if classes is not None else True


def with_fix_reach(report: Report, run: RunData, command: list[str] | None = None) -> Report:
    """``report`` with its verify command kept when the first fix reaches code this job ran, else
    replaced by a note that says why not and what to do. ``command``: the job's launch command
    (default: the one its manifest records)."""
    if command is None and run.manifest is not None:
        command = run.manifest.command
    if not report.fixes or report.verify_command is None:
        return report
    fix = FIXES.get(report.fixes[0])
    if fix is None:
        return report
    paths = [t.path for t in fix.targets]
    if not paths and (report.fix_config or {}).get(fix.name):
        return report  # a fix with no built-in target, pointed at the job's code by the analysis
    seen = run_frames(run)
    hit = reached(paths, seen, script_of(command)) if paths else []
    replaced = []
    if hit and all(_replaced_by_job(path, seen) for path in hit):
        replaced, hit = hit, []  # the job assigns or overrides the target's method: the patch would be lost
    if not paths or hit:
        # The fix's own targets are this job's code: they, not settings derived from structure, apply.
        kept = {k: v for k, v in (report.fix_config or {}).items() if k != fix.name} or None
        return report if kept == report.fix_config else dataclasses.replace(report, fix_config=kept)
    if (report.fix_config or {}).get(fix.name):
        return report  # the analysis pointed the fix at this job's own code (a branch it found)
    derived = next((name for name in report.fixes[1:] if (report.fix_config or {}).get(name)), None)
    if derived is not None:
        # The first fix patches classes this job did not run; the next one was pointed at its code by
        # structure (module lists, a branch): offer that one.
        verify = report.verify_command.replace(f"--fix {fix.name} ", f"--fix {derived} ", 1)
        return dataclasses.replace(
            report, verify_command=verify, fixes=[derived, *[f for f in report.fixes if f != derived]]
        )
    site = report.suggestion.call_site.rsplit("/", 1)[-1] if report.suggestion and report.suggestion.call_site else None
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    ran = (
        f"this job replaces {', '.join(replaced)} with its own (an assignment, or a subclass whose method does not "
        "call the base's), so the patch would never run"
        if replaced
        else "none of which this job ran (not in the frames recorded with its collectives)"
    )
    note = f"No automatic fix for this code: {fix.name} patches {shown}, {ran}. " + (
        f"Change the code at {site} as suggested below, or point the fix at your own functions with "
        f"--config (docs/fixes.md) and run: {report.verify_command} --config FILE"
        if site
        else f"Point the fix at your own functions with --config (docs/fixes.md) and run: "
        f"{report.verify_command} --config FILE"
    )
    return dataclasses.replace(report, verify_command=None, fix_note=note)
