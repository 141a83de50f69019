"""Re-record the golden corpus (``tests/golden/<name>/``) from the fixtures.

    python tests/golden/record.py                    # every case, one after the other
    python tests/golden/record.py --only straggler healthy

For each golden case (a folder here holding ``expected_report.json``) this runs the fixture
``fixtures/<name>/train.py`` under ``moedoctor run`` for real (Gloo, 2 ranks, OMP_NUM_THREADS=1,
from the repository root; ``python`` is the interpreter running this script)::

    python -m moedoctor run --run-dir TMP --force --hang-timeout 10 -- \\
        python -m torch.distributed.run --standalone --nproc_per_node 2 fixtures/<name>/train.py --pg-timeout 10

except ``hardware_like``, ``straggler`` and ``collective_order_inversion``, which run with the
options the end-to-end test (``tests/integration/conftest.py``) gives every fixture, ``--hang-timeout
8`` and ``--pg-timeout 60``: they are diagnosed by the hang timeout (no collective mismatch for online
detection to see: each group's own sequence agrees in an order inversion), and with a process-group
timeout as short as the hang timeout the job's own timeout would race moedoctor's diagnosis (with
10 s, Gloo's timeout ended collective_order_inversion's ranks first: crashed, not diagnosed).

It then copies from the run directory the same entries the case holds now (``traces/``,
``manifest.json``, and where present ``stacks/``, ``gpu/``, ``flight_recorder/``; inside a folder only
files of the kinds it holds now, so no ``*.status``), never ``report.json``, ``job.log`` or the locks.
Paths in those files are kept as recorded (absolute paths of the temporary run directory and of the
fixture scripts), as the corpus always held them: the tests compare call sites with ``endswith``.

``expected_report.json`` takes its truth from ``fixtures/<name>/expected.yaml``, never from
moedoctor: ``pattern``, ``culprit_ranks``, ``fixes`` (``[fix]``, then the registry's other fixes for the
pattern), ``call_site``, and ``verdict``
(``healthy`` for a control without a pattern; ``stuck`` for ``straggler`` / ``not-a-desync`` /
``rank-stopped``; ``desync`` for a hang; for a fixture whose ``failure`` is ``abort`` either
``crashed`` or ``desync``, as the job ended: ``desync`` when ``moedoctor run`` stopped it itself,
exit 124, having seen the mismatch online, ``crashed`` when the abort ended it). Only the facts of
this one recording, the divergence's ``kind``, ``group``, ``seq`` and per-rank ``ops``, are taken
from the analysis of the copied files (which must equal the run's own ``report.json``).

A case is written only when the job ended as the truth says (exit 124 for a hang, 0 for the healthy
control) and both the run's ``report.json`` and ``moedoctor analyze`` of the copied files give the
truth's verdict, pattern, culprit ranks, fixes, group ranks and call site (``endswith``, as
``tests/cli/test_analyze.py`` checks it); otherwise the case is left as it is, the reason printed,
and the script exits 1. The recordings are not deterministic (timestamps, pids, the order of
threads): every run gives different files, with the same diagnosis.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

GOLDEN = Path(__file__).resolve().parent
TESTS = GOLDEN.parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(REPO))

from torchrun_util import JobResult, job_env, live_processes, run_command  # noqa: E402

NPROC = 2
#: (--hang-timeout, --pg-timeout); the cases diagnosed by the hang timeout take the end-to-end test's.
TIMEOUTS = {"hardware_like": ("8", "60"), "straggler": ("8", "60"), "collective_order_inversion": ("8", "60")}
DEFAULT_TIMEOUTS = ("10", "10")
JOB_LIMIT_S = 240.0
STUCK_PATTERNS = ("straggler", "not-a-desync", "rank-stopped")
EXIT_HANG = 124
KEEP_OUT = {"report.json", "job.log"}


class Refused(Exception):
    """The recording does not back the truth: the case is not written."""


def cases() -> list[str]:
    return sorted(p.name for p in GOLDEN.iterdir() if (p / "expected_report.json").is_file())


def command(name: str, run_dir: Path) -> list[str]:
    hang, pg = TIMEOUTS.get(name, DEFAULT_TIMEOUTS)
    return [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--force", "--hang-timeout", hang,
            "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
            f"fixtures/{name}/train.py", "--pg-timeout", pg]


def truth(name: str, exit_code: int) -> dict:
    """What ``expected.yaml`` says the report must be; the verdict of an aborting fixture depends on
    how the job ended (``exit_code`` of ``moedoctor run``), not on the report."""
    y = yaml.safe_load((REPO / "fixtures" / name / "expected.yaml").read_text())
    pattern = y.get("pattern")
    if pattern is None:
        verdict = y.get("verdict", "healthy")
    elif pattern in STUCK_PATTERNS:
        verdict = "stuck"
    elif y.get("failure") == "abort":
        verdict = "desync" if exit_code == EXIT_HANG else "crashed"
    else:
        verdict = "desync"
    return {"verdict": verdict, "pattern": pattern, "culprit_ranks": list(y.get("culprit_ranks") or []),
            "fixes": _fixes(pattern, y.get("fix")), "group_ranks": y.get("group_ranks"),
            "call_site": y.get("call_site"), "failure": y.get("failure")}


def _fixes(pattern: str | None, fix: str | None) -> list[str]:
    """The fixture's fix first, then the other fixes the registry lists for its pattern (a product
    fact, the order a report names them in), e.g. ``expert-zero-term`` after ``expert-dense``."""
    if not fix:
        return []
    from moedoctor.fixes import fixes_for_pattern

    return [fix, *(f.name for f in fixes_for_pattern(pattern or "") if f.name != fix)]


def expected_exit(want: dict) -> tuple[int, ...]:
    if want["pattern"] is None:
        return (0,)
    if want["failure"] == "abort":
        return (EXIT_HANG, 1)
    return (EXIT_HANG,)


def call_sites(doc: dict) -> list[str]:
    """The call sites ``tests/cli/test_analyze.py`` looks in: the divergence's and the suggestion's."""
    div = doc.get("divergence") or {"per_rank": {}}
    sites = [op["call_site"] for op in div["per_rank"].values() if op and op.get("call_site")]
    suggestion = doc.get("suggestion") or {}
    return sites + ([suggestion["call_site"]] if suggestion.get("call_site") else [])


def divergence_facts(doc: dict) -> dict | None:
    div = doc.get("divergence")
    if div is None:
        return None
    return {"kind": div["kind"], "group": {"name": div["group"]["name"], "ranks": div["group"]["ranks"]},
            "seq": div["seq"], "ops": {r: (op["op"] if op else None) for r, op in div["per_rank"].items()}}


def check(doc: dict, want: dict, what: str) -> None:
    """Refuse unless ``doc`` (a report) gives the truth."""
    wrong = [f"{key}: {doc.get(key)!r}, expected.yaml says {want[key]!r}"
             for key in ("verdict", "pattern", "culprit_ranks", "fixes") if doc.get(key) != want[key]]
    if want["pattern"] is not None:
        ranks = (doc.get("divergence") or {}).get("group", {}).get("ranks")
        if ranks != want["group_ranks"]:
            wrong.append(f"divergence group ranks: {ranks!r}, expected.yaml says {want['group_ranks']!r}")
    elif doc.get("divergence") is not None:
        wrong.append("a divergence in a healthy control")
    if want["call_site"] and not any(s.endswith(want["call_site"]) for s in call_sites(doc)):
        wrong.append(f"call site: none of {call_sites(doc)} ends with {want['call_site']!r}")
    if wrong:
        raise Refused(f"{what} disagrees with expected.yaml: " + "; ".join(wrong) + f" ({doc.get('summary')})")


def copy_entries(case: Path, run_dir: Path, dest: Path) -> None:
    """Copy from ``run_dir`` the entries ``case`` holds now, folders with the kinds of files they hold."""
    for entry in sorted(case.iterdir()):
        if entry.name == "expected_report.json" or entry.name in KEEP_OUT or entry.name.endswith(".lock"):
            continue
        source = run_dir / entry.name
        if entry.is_file():
            if not source.is_file():
                raise Refused(f"the run directory has no {entry.name}")
            shutil.copy2(source, dest / entry.name)
            continue
        suffixes = {p.suffix for p in entry.iterdir() if p.is_file()}
        files = sorted(p for p in source.glob("*") if p.is_file() and p.suffix in suffixes) if source.is_dir() else []
        if not files:
            raise Refused(f"the run directory has no {entry.name}/ files of the kinds {sorted(suffixes)}")
        (dest / entry.name).mkdir()
        for p in files:
            shutil.copy2(p, dest / entry.name / p.name)


def analyze_copy(folder: Path) -> dict:
    from moedoctor.analysis import analyze, load_run
    from moedoctor.render.json_report import report_to_dict

    return report_to_dict(analyze(load_run(folder)))


def stop_survivors(run_dir: Path) -> list[int]:
    """SIGKILL what is left of this job (its processes carry our run directory in their environment)."""
    import os
    import signal

    mark = f"MOEDOCTOR_RUN_DIR={run_dir.resolve()}".encode()
    pids = live_processes(lambda proc: mark in (proc / "environ").read_bytes().split(b"\0"))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def record(name: str, keep: bool) -> str:
    case = GOLDEN / name
    work = Path(tempfile.mkdtemp(prefix=f"moedoctor-golden-{name}-"))
    run_dir = work / "run"
    try:
        result: JobResult = run_command(command(name, run_dir), JOB_LIMIT_S, env=job_env(OMP_NUM_THREADS="1"),
                                        cwd=REPO)
        survivors = stop_survivors(run_dir)
        log = f"--- moedoctor run, exit {result.returncode}, {result.seconds:.0f} s ---\n{result.tail(30)}"
        if survivors:
            raise Refused(f"processes of the job outlived moedoctor run (killed: {survivors})\n{log}")
        want = truth(name, result.returncode)
        if result.returncode not in expected_exit(want):
            raise Refused(f"moedoctor run exited {result.returncode}, expected {expected_exit(want)}\n{log}")
        report_path = run_dir / "report.json"
        if not report_path.is_file():
            raise Refused(f"no report.json in the run directory\n{log}")
        report = json.loads(report_path.read_text())
        check(report, want, "the run's report.json")

        staged = work / "golden"
        staged.mkdir()
        copy_entries(case, run_dir, staged)
        doc = analyze_copy(staged)
        check(doc, want, "moedoctor analyze of the copied files")
        facts = divergence_facts(doc)
        if facts != divergence_facts(report):
            raise Refused(f"the copied files give another divergence ({facts}) than the run's report.json "
                          f"({divergence_facts(report)})")

        expected = {key: want[key] for key in ("verdict", "pattern", "culprit_ranks", "fixes")}
        expected.update(divergence=facts, call_site=want["call_site"])
        (staged / "expected_report.json").write_text(json.dumps(expected, indent=1) + "\n")
        for entry in case.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        for entry in staged.iterdir():
            shutil.move(str(entry), case / entry.name)
        div = "no divergence" if facts is None else \
            f"{facts['kind']} on group {facts['group']['name']} seq {facts['seq']} {facts['ops']}"
        return f"{want['verdict']} {want['pattern']} culprits {want['culprit_ranks']}: {div} " \
               f"(exit {result.returncode}, {result.seconds:.0f} s)"
    finally:
        if keep:
            print(f"  run directory kept: {run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="re-record only these cases")
    parser.add_argument("--keep", action="store_true", help="keep each temporary run directory (its path is printed)")
    args = parser.parse_args(argv)
    names = cases()
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        parser.error(f"no golden case {', '.join(unknown)} (cases: {', '.join(names)})")
    failed = []
    for name in names:
        if args.only and name not in args.only:
            continue
        print(f"{name}: recording ...", flush=True)
        try:
            print(f"{name}: written: {record(name, args.keep)}", flush=True)
        except Refused as e:
            failed.append(name)
            print(f"{name}: REFUSED, left as it was: {e}", file=sys.stderr, flush=True)
    if failed:
        print(f"not re-recorded: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
