"""The parameter consistency section (``moedoctor run --check-params``, ``moedoctor analyze --params``)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from moedoctor.layout import PARAMS, PARAMS_CHECK, RunDir
from moedoctor.wording import phase_label
from moedoctor.analysis.report_json import add_params
from moedoctor.analysis.params import SHARD_IDENTICAL, ParamsCheck, check_run_dir, has_params

_KIND_TEXT = {
    SHARD_IDENTICAL: "sharded or per-rank, yet identical across ranks",
    "replicated-differs": "replicated, but differs across ranks",
    "optimizer-state-differs": "optimizer state differs where the parameter agrees",
}
CHECK_FILE = PARAMS_CHECK


def run_params_check(path: Path) -> ParamsCheck | None:
    """The check of a run directory (``None`` when it holds no fingerprints); written to params/check.json."""
    if not has_params(path):
        return None
    events = {}
    try:
        from moedoctor.analysis import load_run

        events = {t.rank: t.events for t in load_run(path).traces}
    except Exception:  # noqa: BLE001 - without traces the check still runs, without attribution
        pass
    check = check_run_dir(path, events)
    try:
        (RunDir(Path(path)).params_check).write_text(json.dumps(check.to_json(), indent=1) + "\n")
        add_params(RunDir(Path(path)).report, check.to_json())  # the run's report gets the section too
    except (OSError, ValueError):
        pass  # the check was printed; its files are a convenience
    return check


def render_params_check(check: ParamsCheck, console: Console, limit: int = 12) -> None:
    head = f"Parameter check: ranks {','.join(map(str, check.ranks))}; points {', '.join(check.points) or 'none'}"
    if not check.findings:
        console.print(f"{head}: consistent", highlight=False, soft_wrap=True)
    else:
        pattern = f" [bold red]{check.pattern}[/]" if check.pattern else ""
        console.print(f"{head}:{pattern} {len(check.findings)} parameter(s)", highlight=False, soft_wrap=True)
    for f in check.findings[:limit]:
        console.print(
            f"  {escape(f.name)} at {f.point}: {_KIND_TEXT.get(f.kind, f.kind)} (ranks "
            f"{','.join(map(str, f.differing or f.ranks))}; score {f.confidence:.2f}): {escape(f.evidence)}",
            highlight=False,
            soft_wrap=True,
        )
        o = f.overwrite
        if o is not None:
            where = f" at {escape(o.call_site)}" if o.call_site else " (not matched in the trace)"
            more = f" (phase {phase_label(o.phase)}, step {o.step})" if o.phase is not None else ""
            console.print(
                f"    overwritten by {o.op} from rank {o.src} on ranks {','.join(map(str, o.group))}{where}{more}",
                highlight=False,
                soft_wrap=True,
            )
    if len(check.findings) > limit:
        console.print(f"  ... and {len(check.findings) - limit} more ({PARAMS}/{CHECK_FILE})", highlight=False)
    if check.pattern:
        console.print(
            "  Fix: make per-rank parameters DTensors Shard(0) on their expert-parallel mesh, or leave them out of "
            "the broadcast (docs/analysis.md, overwritten-shards)",
            highlight=False,
            soft_wrap=True,
        )
    for note in check.notes:
        console.print(f"  note: {escape(note)}", highlight=False, soft_wrap=True)


def print_params_check(path: Path, console: Console) -> ParamsCheck | None:
    check = run_params_check(path)
    if check is None:
        console.print(
            "Parameter check: no fingerprints were written (no rank reached its first forward)",
            highlight=False,
            soft_wrap=True,
        )
        return None
    render_params_check(check, console)
    return check
