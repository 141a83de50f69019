"""The worker side of the fixes: install the named fixes in this process and record what they did.

The bootstrap calls ``activate_from_env`` once torch is imported, when ``MOEDOCTOR_FIXES`` names
fixes. Each fix gets a ``FixRuntime``: it patches the fix's targets as their modules are imported
(``__main__`` at ``init_process_group``), counts calls to the replacements, and keeps the results
of the fix's numerical checks. All of it is written to
``RUN_DIR/fixes/<fix>/rank-<N>.json`` (read back by ``moedoctor.fixes.status``) whenever it
changes and when the process group is destroyed, so a rank that dies keeps what it had.

A fix whose targets never show up says so on stderr when the job ends: silence would read as
"applied".
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moedoctor import environment
from moedoctor._imports import when_imported
from moedoctor.fixes.base import Fix, Target
from moedoctor.layout import RunDir, fix_status_name

STATUS_FORMAT = 1

_runtimes: list[FixRuntime] = []
_pending_main: list[tuple[FixRuntime, Target, Callable]] = []


@dataclass
class TargetState:
    path: str
    note: str
    patched: bool = False
    calls: int = 0
    error: str | None = None


@dataclass
class CheckState:
    """One named check, aggregated over every time it ran in this process."""

    name: str
    passed: bool | None = None  # None: could not be checked (``detail`` says why)
    runs: int = 0
    passes: int = 0
    failures: int = 0
    detail: str = ""
    worst: float | None = None  # e.g. the largest difference seen


@dataclass
class FixRuntime:
    fix: Fix
    config: dict
    status_dir: Path | None
    checks_enabled: bool
    targets: dict[str, TargetState] = field(default_factory=dict)
    checks: dict[str, CheckState] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _branches: dict[str, tuple[str, int]] = field(default_factory=dict, repr=False)

    @property
    def rank(self) -> int | None:
        """This worker's global rank; None in a process that is not a rank (torchrun's agent)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None

    # -- used by fix modules ------------------------------------------------------------------------

    def patch(self, target: Target, replace: Callable[[Any, Any], Any]) -> None:
        """Replace ``target`` with ``replace(original, owner)`` once its module is imported."""
        self.targets.setdefault(target.path, TargetState(target.path, target.note))
        if target.module == "__main__":
            _pending_main.append((self, target, replace))
        else:
            when_imported(target.module, lambda module: self._apply(module, target, replace))

    def branch(self, branch: dict, handler: Callable[[Any, int], Any]) -> None:
        """Decide what the job's ``if`` at ``branch`` (``{file, line}``, rewritten as the file is
        compiled: ``moedoctor.fixes.rewrite``) sees: ``handler(local value, line)``."""
        from moedoctor.fixes import rewrite

        path = f"{branch['file']}:{branch['line']}"
        state = self.targets.setdefault(path, TargetState(path, "an if of the job's code"))
        key = (os.path.normpath(branch["file"]), branch["line"])
        self._branches[path] = key

        def counted(value: Any, line: int) -> Any:
            state.calls += 1
            state.patched = True
            if state.calls == 1:
                self.write()
            return handler(value, line)

        rewrite.on_branch(self.fix.name, counted)

    def check(self, name: str, passed: bool | None, detail: str = "", worst: float | None = None) -> None:
        """Record one run of a numerical check. ``passed=None``: it could not run (say why)."""
        with self._lock:
            state = self.checks.setdefault(name, CheckState(name))
            before = state.passed
            state.runs += 1
            if passed is False:
                state.failures += 1
                state.detail = detail
            elif passed is True:
                state.passes += 1
                state.detail = detail if not state.failures else state.detail
            elif not state.failures and not state.passes:
                state.detail = detail
            state.passed = False if state.failures else (True if state.passes else None)
            if worst is not None:
                state.worst = worst if state.worst is None else max(state.worst, worst)
            changed = state.runs == 1 or state.passed != before
        if changed:
            self.write()

    def at_finish(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the job ends (process group destroyed, or exit), before the last write."""
        self.finishers.append(callback)

    def note(self, message: str) -> None:
        """Something the user must hear about (a refusal, a target that does not fit): stderr and status."""
        if message in self.notes:
            return
        self.notes.append(message)
        sys.stderr.write(f"moedoctor: fix {self.fix.name} (rank {self.rank}): {message}\n")
        sys.stderr.flush()
        self.write()

    # -- patching -------------------------------------------------------------------------------------

    def _apply(self, module, target: Target, replace: Callable[[Any, Any], Any]) -> None:
        state = self.targets[target.path]
        owner = module
        *parents, attr = target.qualname.split(".")
        try:
            for part in parents:
                owner = getattr(owner, part)
            original = getattr(owner, attr)
        except AttributeError:
            state.error = f"{target.module} has no {target.qualname}"
            self.write()
            return
        try:
            replacement = replace(original, owner)
        except Exception as e:  # the fix refused this target: say so, leave it alone
            state.error = f"not patched: {e}"
            self.write()
            return
        setattr(owner, attr, self._counting(state, replacement))
        state.patched = True
        self.write()

    def _counting(self, state: TargetState, function: Callable) -> Callable:
        @functools.wraps(function)
        def counted(*args, **kwargs):
            state.calls += 1
            if state.calls == 1:
                self.write()
            return function(*args, **kwargs)

        counted.__moedoctor_fix__ = self.fix.name  # type: ignore[attr-defined]
        return counted

    # -- the record -------------------------------------------------------------------------------

    def status(self) -> dict:
        return {
            "format": STATUS_FORMAT,
            "fix": self.fix.name,
            "rank": self.rank,
            "pid": os.getpid(),
            "checks_enabled": self.checks_enabled,
            "targets": [asdict(t) for t in self.targets.values()],
            "checks": [asdict(c) for c in self.checks.values()],
            "notes": list(self.notes),
        }

    def write(self) -> None:
        if self.status_dir is None or self.rank is None:
            return
        folder = self.status_dir / self.fix.name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / fix_status_name(self.rank)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.status(), indent=1))
            os.replace(tmp, path)
        except OSError as e:
            sys.stderr.write(f"moedoctor: fix {self.fix.name}: cannot write its status: {e}\n")

    def finish(self) -> None:
        """At the end of the job: run the fix's last checks, say loudly if it did nothing here."""
        if self.rank is None:
            return  # not a rank (the launcher imports torch too): nothing to say
        for callback in self.finishers:
            try:
                callback()
            except Exception as e:  # a check that cannot finish is a finding, not a crash of the job
                self.note(f"final check failed to run: {e!r}")
        from moedoctor.fixes import rewrite

        for path, key in self._branches.items():
            state = self.targets[path]
            if key in rewrite.applied:
                state.patched = True
            elif not state.patched:
                state.error = (
                    f"{path}: not rewritten (the file was compiled before moedoctor could, or no `if` "
                    "starts on that line)"
                )
        if not any(t.patched for t in self.targets.values()):
            paths = [t.path for t in self.targets.values()]
            looked = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            errors = "; ".join(t.error for t in self.targets.values() if t.error)
            self.note(
                f"did NOTHING: none of its targets was found in this job (looked for {looked})"
                + (f"; {errors}" if errors else "")
            )
        elif not any(t.calls for t in self.targets.values()):
            patched = ", ".join(t.path for t in self.targets.values() if t.patched)
            self.note(f"patched {patched} but the job never called it")
        self.write()


def agreed_branch(runtime: FixRuntime, agree: str) -> Callable[[Any, int], bool]:
    """A wrapped ``if``'s test made collective: its local truth all-reduced over the default group
    (``any``: true when any rank's is; ``all``: when every rank's is). One 2-element all-reduce
    (MAX of [x, -x]) gives both the answer and whether the ranks disagreed; the check "ranks
    disagreed and took one branch" passes on a rank once an evaluation had them disagree (the fault
    recurred and the fix decided it), and stays unestablished when they never did (the fix was not
    exercised: the wrong ``if``, or the fault did not come back)."""
    import torch
    import torch.distributed as dist

    seen = {"evaluations": 0, "disagreed": 0, "overridden": 0}

    def agreed(value: Any, line: int) -> bool:
        local = bool(value.item() if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1 else value)
        if not (dist.is_available() and dist.is_initialized()):
            return local
        x = 1.0 if local else 0.0
        both = torch.tensor([x, -x], device=collective_device(None))
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        anyone, everyone = both[0].item() > 0.5, -both[1].item() > 0.5
        result = anyone if agree == "any" else everyone
        seen["evaluations"] += 1
        seen["disagreed"] += anyone != everyone
        seen["overridden"] += result != local
        if anyone != everyone or seen["evaluations"] == 1:
            text = (
                f"line {line}: the ranks disagreed at {seen['disagreed']} of {seen['evaluations']} evaluation(s) "
                f"and took one branch ({seen['overridden']} local decision(s) overridden on this rank)"
            )
            runtime.check(
                "ranks disagreed and took one branch",
                True if seen["disagreed"] else None,
                text if seen["disagreed"] else f"line {line}: the ranks never disagreed (the fix was not exercised)",
            )
        return result

    return agreed


def collective_device(group):
    """Where a fix's own small collective on ``group`` must live: the current GPU for NCCL, else CPU."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def first_mapping_argument(args: tuple, kwargs: dict) -> int | str | None:
    """Where a wrapped call's first mapping argument is (a state dict, a metrics dict): its position
    in ``args`` or its keyword; None when there is none."""
    from collections.abc import Mapping

    for index, value in enumerate(args):
        if isinstance(value, Mapping):
            return index
    for name, value in kwargs.items():
        if isinstance(value, Mapping):
            return name
    return None


def activate_from_env() -> None:
    """Install the fixes named in ``MOEDOCTOR_FIXES``; called once torch is imported."""
    from moedoctor.fixes import FIXES

    names = environment.fixes()
    config_path = environment.fix_config()
    config = json.loads(Path(config_path).read_text()) if config_path else {}
    run_dir = environment.run_dir()
    status_dir = RunDir(Path(run_dir)).fixes if run_dir else None
    checks = environment.fix_checks()
    for name in names:
        fix = FIXES.get(name)
        if fix is None:
            sys.stderr.write(
                f"moedoctor: unknown fix {name!r} in {environment.FIXES.name}; known: {', '.join(FIXES)}\n"
            )
            continue
        runtime = FixRuntime(fix, config.get(name, {}), status_dir, checks)
        fix.install(runtime)  # registers its targets through runtime.patch
        _runtimes.append(runtime)
        runtime.write()
    if _runtimes:
        from moedoctor import _process_group_hooks as process_group_hooks

        process_group_hooks.after_init(_patch_main)
        process_group_hooks.before_destroy(_finish_all)
        atexit.register(_finish_all)


def _patch_main() -> None:
    """At ``init_process_group``: the script's functions are defined by now, and it calls them by name."""
    main = sys.modules.get("__main__")
    while _pending_main:
        runtime, target, replace = _pending_main.pop(0)
        runtime._apply(main, target, replace)


_finished = False


def _finish_all() -> None:
    global _finished
    if _finished:
        return
    _finished = True
    for runtime in _runtimes:
        runtime.finish()
