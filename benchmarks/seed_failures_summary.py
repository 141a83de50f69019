"""The markdown summary of ``benchmarks/seed_failures_nccl.sh``: one table row per step, from the steps
it ran (``steps.tsv``: fixture, step, exit, seconds, run dir, what was expected) and what each run
wrote (report.json, manifest.json, verification.json, params/check.json), each judged against the
fixture's ``expected.yaml``.

    python3 benchmarks/seed_failures_summary.py STEPS_TSV DEVICE_TXT BACKEND TOTAL_S BUDGET_S > summary.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def load(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def cell(text: object, limit: int = 220) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def diagnosis(run: Path, expected: dict) -> tuple[bool, str]:
    report, manifest = load(run / "report.json"), load(run / "manifest.json") or {}
    if report is None:
        return False, "no report.json"
    hang = manifest.get("hang") or {}
    latency = hang.get("detection_latency_s")
    how = f"stopped by {hang.get('trigger')}" + (f" {latency:.2f} s after the op" if latency is not None else "")
    how = how if hang else f"job ended by itself ({manifest.get('status')})"
    sites = sorted({str(op.get("call_site", "")).rsplit("/", 1)[-1] for op in
                    ((report.get("divergence") or {}).get("per_rank") or {}).values() if isinstance(op, dict)} - {""})
    said = f"{report.get('verdict')} `{report.get('pattern')}`, culprits {report.get('culprit_ranks')}"
    if sites:
        said += f", at {', '.join(sites)}"
    slow = (report.get("slow") or {}).get("storms") or []
    if slow:
        s = slow[0]
        said += f"; slow: {s.get('count')} {s.get('op')}s from {str(s.get('call_site')).rsplit('/', 1)[-1]} in " \
                f"{float(s.get('seconds') or 0):.2f} s"
    params = load(run / "params" / "check.json")
    if params is not None:
        named = sorted({f.get("name") for f in params.get("findings") or [] if isinstance(f, dict)} - {None})
        said += f"; parameter check: `{params.get('pattern')}` ({', '.join(named)})"
    failure = expected.get("failure")
    if failure == "slow":  # no desync: the report is healthy and names the storm at the call site
        ok = report.get("verdict") == expected.get("verdict", "healthy") and any(
            str(s.get("call_site", "")).endswith(str(expected.get("call_site"))) for s in slow)
    elif failure == "silent":  # nothing hangs: the parameter check names it
        ok = params is not None and params.get("pattern") == expected.get("pattern")
    else:
        ok = report.get("pattern") == expected.get("pattern") and report.get("culprit_ranks") == expected.get(
            "culprit_ranks")
    return ok, f"{said}; {how}"


def verification(run: Path, want_pass: bool) -> tuple[bool, str]:
    doc = load(run / "verification.json")
    if doc is None:
        return False, "no verification.json"
    passed = bool(doc.get("passed"))
    checks = doc.get("checks") or []
    if passed:  # the fix's own checks first: they are what the row is about
        fixes = tuple(f"{f}" for f in doc.get("fixes") or ())
        own = [c for c in checks if str(c.get("name", "")).startswith(fixes)] if fixes else []
        shown = [f"{c['name']}: {c['after']}" for c in own + [c for c in checks if c not in own]
                 if c.get("passed") and c.get("required")]
        text = "VERIFIED: " + "; ".join(shown)
    else:
        text = "NOT VERIFIED: " + "; ".join(doc.get("reasons") or [])
    return passed == want_pass, text


def clean_params(run: Path) -> tuple[bool, str]:
    report = load(run / "report.json")
    if report is None:
        return False, "no report.json"
    params = load(run / "params" / "check.json")
    said = f"{report.get('verdict')} `{report.get('pattern')}`"
    if params is not None:
        said += f"; parameter check: `{params.get('pattern')}`, {len(params.get('findings') or [])} finding(s)"
    clean = params is not None and params.get("pattern") is None and not params.get("findings")
    return report.get("verdict") == "healthy" and report.get("pattern") is None and clean, said


def completion(run: Path) -> tuple[bool, str]:
    """The completion the recorder observed (report.json ``completion``): every p2p op decided."""
    report = load(run / "report.json")
    done = (report or {}).get("completion")
    if not isinstance(done, dict):
        return False, "no completion in report.json"
    p2p = done.get("p2p") or {}
    said = f"{done.get('summary')}; p2p ops observed {p2p.get('observed')} of {p2p.get('events')}"
    return report.get("verdict") == "healthy" and done.get("observed") == done.get("provable") and not p2p.get(
        "unknown"), said


def main() -> None:
    steps_tsv, device_txt, backend, total, budget = sys.argv[1:6]
    rows, all_ok, fixtures = [], True, []
    for line in Path(steps_tsv).read_text().splitlines():
        fixture, step, rc, secs, run, expect = line.split("\t")
        if fixture not in fixtures and expect != "completion":
            fixtures.append(fixture)
        spec = REPO / "fixtures" / fixture / "expected.yaml"
        expected = (yaml.safe_load(spec.read_text()) or {}) if spec.exists() else {}
        if rc == "skipped":
            ok, said = False, "skipped: the run's time budget was spent"
        elif expect == "diagnose":
            ok, said = diagnosis(Path(run), expected)
        elif expect == "verified":
            ok, said = verification(Path(run), True)
            ok = ok and rc == "0"
        elif expect == "completion":
            ok, said = completion(Path(run))
            ok = ok and rc == "0"
        elif expect == "refused":
            ok, said = verification(Path(run), False)
            ok = ok and rc == "1"
        else:  # clean: the fixture's own fix under --check-params
            ok, said = clean_params(Path(run))
            ok = ok and rc == "0"
        all_ok = all_ok and ok
        mark = "yes" if ok else "**no**"
        rows.append(f"| {fixture} | {cell(step, 60)} | {rc} | {secs} | {mark} | {cell(said, 400)} |")
    device = Path(device_txt).read_text().strip() if Path(device_txt).exists() else "?"
    print(f"# The seeds' four further failures on {backend.upper()} (`benchmarks/seed_failures_nccl.sh`)\n")
    print(f"{device}; 2 ranks; {len(fixtures)} fixtures in {total} s (budget {budget} s). Each fixture is "
          "diagnosed under `moedoctor run --hang-timeout 20` (its pattern and culprits must be `expected.yaml`'s), "
          "verified with the fix the report names (`overwritten_shards`, which has no fix module: its "
          "`--apply-fix` run under `--check-params` must be healthy), and a wrong fix must be refused (exit 1, "
          "NOT VERIFIED). Last, `completion`: `benchmarks/nccl_completion.py` under `moedoctor run`, whose every "
          "collective and p2p op (batch_isend_irecv) must be observed complete.\n")
    print(f"**All as expected: {'yes' if all_ok and len(fixtures) == 4 else 'no'}.**\n")
    print("| fixture | step | exit | s | as expected | what it said |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
