"""Read back what the fixes did in each worker (``RUN_DIR/fixes/<fix>/rank-<N>.json``, written by
``moedoctor.fixes.runtime``), for ``moedoctor verify``. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.layout import FIX_STATUS_FILES, RunDir


@dataclass(frozen=True)
class TargetStatus:
    path: str
    note: str
    patched: bool
    calls: int
    error: str | None


@dataclass(frozen=True)
class CheckStatus:
    name: str
    passed: bool | None
    runs: int
    failures: int
    detail: str
    worst: float | None


@dataclass(frozen=True)
class RankFixStatus:
    rank: int
    targets: tuple[TargetStatus, ...]
    checks: tuple[CheckStatus, ...]
    notes: tuple[str, ...]

    @property
    def applied(self) -> bool:
        """Patched somewhere and called at least once in this rank."""
        return any(t.patched and t.calls for t in self.targets)


@dataclass
class FixStatus:
    """One fix across the ranks that wrote a status."""

    fix: str
    ranks: dict[int, RankFixStatus] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def applied_ranks(self) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s.applied)

    def calls(self) -> dict[str, int]:
        """Calls per patched target, summed over ranks."""
        totals: dict[str, int] = {}
        for status in self.ranks.values():
            for t in status.targets:
                if t.patched:
                    totals[t.path] = totals.get(t.path, 0) + t.calls
        return totals

    def checks(self) -> dict[str, list[tuple[int, CheckStatus]]]:
        by_name: dict[str, list[tuple[int, CheckStatus]]] = {}
        for rank, status in sorted(self.ranks.items()):
            for check in status.checks:
                by_name.setdefault(check.name, []).append((rank, check))
        return by_name

    def notes(self) -> list[str]:
        seen: dict[str, list[int]] = {}
        for rank, status in sorted(self.ranks.items()):
            for note in status.notes:
                seen.setdefault(note, []).append(rank)
        return [f"{note} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for note, r in seen.items()]

    def searched(self) -> list[str]:
        paths: dict[str, None] = {}
        for status in self.ranks.values():
            for t in status.targets:
                paths.setdefault(t.path)
        return list(paths)


def read_fix_status(run_dir: Path, fix: str) -> FixStatus:
    result = FixStatus(fix)
    folder = RunDir(Path(run_dir)).fixes / fix
    for path in sorted(folder.glob(FIX_STATUS_FILES)) if folder.is_dir() else ():
        try:
            data = json.loads(path.read_text())
            result.ranks[int(data["rank"])] = RankFixStatus(
                rank=int(data["rank"]),
                targets=tuple(
                    TargetStatus(t["path"], t.get("note", ""), bool(t["patched"]), int(t["calls"]), t.get("error"))
                    for t in data["targets"]
                ),
                checks=tuple(
                    CheckStatus(
                        c["name"], c["passed"], int(c["runs"]), int(c["failures"]), c.get("detail", ""), c.get("worst")
                    )
                    for c in data["checks"]
                ),
                notes=tuple(data.get("notes", ())),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            result.problems.append(f"{path}: unreadable ({e!r})")
    return result
