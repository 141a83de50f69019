"""What ``moedoctor verify`` reruns, and with what: the policy that fills in what the user left out.

- the job: ``--run RUN_DIR``'s recorded command, or the command after ``--`` (not both; torchrun only);
- the fixes' config: ``--config FILE``, else the settings the analysis derived from the original run
  (its ``report.json``'s ``fix_config``, for the fixes asked for);
- where: ``--run-dir``, else ``RUN_DIR/verify-FIXES`` with ``--run``, else a new folder under
  ``./moedoctor-runs/``;
- the recorder: ``--recorder``, else the original run's (so step times compare), else ``auto``;
- the hang timeout: ``--hang-timeout``, else the original run's, else ``DEFAULT_HANG_TIMEOUT``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moedoctor.errors import MoedoctorError
from moedoctor.fixes import FIXES, get_fix
from moedoctor.fixes.config import load_fix_config, validate_fix_config
from moedoctor.runner.command import check_torchrun
from moedoctor.runner.rundir import RunDir, default_run_dir, prepare_run_dir
from moedoctor.verification.verify import OriginalRun, load_original

#: ``moedoctor verify``'s hang timeout when neither ``--hang-timeout`` nor the original run gives one.
DEFAULT_HANG_TIMEOUT = 60.0


@dataclass(frozen=True)
class VerifyPlan:
    fixes: list[str]
    command: list[str]
    original: OriginalRun | None
    fix_config: dict
    run_dir: Path  # prepared (and locked) for the rerun
    recorder: str  # the recorder asked for: auto, native or python
    hang_timeout: float


def plan_verify(
    fix: list[str],
    *,
    run: Path | None = None,
    command: list[str] | None = None,
    config: Path | None = None,
    run_dir: Path | None = None,
    force: bool = False,
    recorder: str = "",
    hang_timeout: float | None = None,
) -> VerifyPlan:
    """The rerun ``moedoctor verify`` makes of these options (its run directory prepared);
    ``MoedoctorError`` when they do not make one."""
    fixes = [get_fix(name).name for name in dict.fromkeys(fix)]
    original = load_original(run) if run is not None else None
    command = list(command or [])
    if original is not None and command:
        raise MoedoctorError("give either --run RUN_DIR or the command after --, not both")
    if original is None and not command:
        raise MoedoctorError(
            "nothing to rerun: give --run RUN_DIR (a run of moedoctor run) or the command "
            "after --, e.g. moedoctor verify --fix NAME -- torchrun --nproc_per_node 2 train.py"
        )
    command = check_torchrun(original.command if original else command)
    fix_config = load_fix_config(config, FIXES.values()) if config is not None else {}
    derived = (original.report or {}).get("fix_config") if original is not None and config is None else None
    if derived:
        # The settings the analysis derived from this job's code (the decision's `if`), for the fixes asked for.
        fix_config = validate_fix_config(
            {k: v for k, v in derived.items() if k in fixes},
            FIXES.values(),
            f"{RunDir(original.path).report} fix_config",
        )
    if run_dir is None:
        run_dir = _default_rerun_dir(original.path, fixes) if original else default_run_dir(Path("moedoctor-runs"))
    prepare_run_dir(run_dir, command, force)
    return VerifyPlan(
        fixes=fixes,
        command=command,
        original=original,
        fix_config=fix_config,
        run_dir=run_dir,
        recorder=recorder or (original.manifest.recorder if original else None) or "auto",
        hang_timeout=hang_timeout or (original.hang_timeout if original else None) or DEFAULT_HANG_TIMEOUT,
    )


def _default_rerun_dir(original: Path, fixes: list[str]) -> Path:
    base = original / ("verify-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", "+".join(fixes)))
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
