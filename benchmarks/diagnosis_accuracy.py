"""How often moedoctor names the right pattern and culprit on code it was not tuned on.

Runs every fault variant of ``fixtures/variants/<pattern>/<variant>.py`` (its ``<variant>.yaml``
says the true pattern, ranks, culprits, call site and fix) and every healthy job of
``fixtures/healthy_*`` and ``fixtures/variants/healthy/healthy_*`` under ``moedoctor run``
(``--backend`` passed to the jobs), reads each ``report.json``, then runs the ``moedoctor verify``
command the report printed where the variant has a fix. Prints a confusion matrix (true pattern x
reported pattern), the mechanism (level 1, ``moedoctor.analysis.mechanisms``: right when it is one of
those ``MECHANISMS`` lists for the true pattern, or the yaml's ``mechanism``), culprit accuracy, the
confident wrong calls (a named pattern that is not the true one; ``unknown-desync`` and "no pattern"
are not confident), the verify results, the false alarms on the healthy jobs, then the same for
the runs' own Flight Recorder dumps (``RUN_DIR/flight_recorder/``, written when the hang watchdog
asked the ranks for a snapshot: analysed alone, as ``moedoctor analyze DIR`` reads them), and for
their py-spy stacks alone (``moedoctor triage``'s reading: mechanism and pattern), and last, one line:

    accuracy: mechanism N/M, pattern N/M, culprit N/M, wrong-confident N, verify-passed N/K, false-alarms N/H

    python benchmarks/diagnosis_accuracy.py [--backend gloo|nccl] [--only PATTERN[,PATTERN]] [--no-verify]
        [--no-healthy] [--keep DIR] [--jobs N] [--variants DIR] [--healthy-dir DIR] [--reanalyze DIR]

``--reanalyze DIR`` runs no job: it analyzes again the run directories a former ``--keep DIR`` left
(what a classifier change does to the same recordings, in seconds). ``--variants DIR`` reads the
variants from another folder laid out the same way (a held-out corpus), ``--healthy-dir DIR`` (repeatable)
the healthy jobs (``DIR/healthy_*/``).

A straggler variant's "pattern" is ``straggler``; the verdict it must get is ``stuck``. Expect about
40 s per variant on 2 CPU cores (each one hangs until moedoctor detects it).

A variant whose yaml says ``requires: transformers4`` runs (``moedoctor run``, the job's workers and the
verify command) with ``.venv-tf4/bin/python``, the transformers 4.53.2 environment of
``tests/integration/test_transformers4.py``, and with ``--recorder python`` (the native recorder is built
once per environment: the venv would build its own, 40-160 s); without that venv it is listed as skipped
and not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from healthy_corpus import run as run_job  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VARIANTS = REPO / "fixtures" / "variants"
FIXTURES = REPO / "fixtures"
#: What moedoctor prints when it raises an alarm on a job (online desync, hang watchdog).
ALARMS = ("moedoctor: desync", "moedoctor: hang", "Desync detected while the job ran", "No trace after")
#: Patterns that claim nothing specific: never a confident call.
UNNAMED = (None, "unknown-desync")
#: The mechanisms each pattern produces in the traces (the catalogue's account of the pattern, read
#: structurally): a variant's mechanism is right when it is one of these (or the yaml's ``mechanism``).
#: Patterns that do not hang (``failure: slow`` / ``silent``) have none.
MECHANISMS = {
    "all-to-all-split-mismatch": {"different-splits", "different-shape"},
    "checkpoint-recompute-mismatch": {"rank-outside-collective"},  # the recomputing rank raised
    "collective-in-checkpointed-region": {"skipped-collective", "extra-collective", "different-op", "wait-cycle"},
    "collective-order-inversion": {"wait-cycle", "different-op"},
    # An idle expert shortens a per-expert loop of FSDP unit collectives (loop-trip-count); DDP's
    # reducer raises on the idle rank (rank-outside-collective, crashed).
    "inactive-experts": {"different-shape", "different-op", "skipped-collective", "extra-collective",
                         "loop-trip-count", "rank-outside-collective"},
    # The metric meets a collective that varies per rank: an idle expert's FSDP unit left out of a
    # per-expert loop, another micro-batch's collective.
    "inflight-metric-allreduce": {"extra-collective", "different-op", "different-shape", "loop-trip-count",
                                  "wait-cycle"},
    # Without backward hooks to show the restart, a different count is a different op at one position.
    "microbatch-count-mismatch": {"loop-trip-count", "skipped-collective", "extra-collective", "different-op"},
    "rank-conditional-collective": {"extra-collective", "skipped-collective", "different-op", "wait-cycle"},
    "shape-mismatch": {"different-shape", "different-dtype", "different-reduce-op"},
    "skipped-optimizer-step": {"skipped-collective", "loop-trip-count", "different-op", "wait-cycle"},
    "straggler": {"rank-outside-collective"},
    # The rank with fewer keys leaves the per-key loop (loop-trip-count) into the save's next
    # collective, which the others have not issued yet (extra-collective, where no loop run shows).
    "uneven-dtensor-allgather": {"loop-trip-count", "extra-collective", "skipped-collective", "different-op",
                                 "wait-cycle"},
}
#: The interpreter of the environment a yaml's ``requires`` names.
ENVIRONMENTS = {"transformers4": REPO / ".venv-tf4" / "bin" / "python"}




def same_trace_fact(label: str, reported: dict | None, culprits: list[int] | None = None) -> bool:
    """Whether the reported mechanism (``{"mechanism", "ranks", "others", "ops"}``) is the same trace
    fact as the yaml's ``label`` under another name (``fixtures/variants/README.md``, "Mechanisms"):

    - ``skipped-collective`` by the yaml's culprits == ``extra-collective`` by exactly the other
      members (and the reverse): the trace shows one side issuing a collective the other side does
      not; which side is the normal one is a reading of the history, not another fact;
    - ``different-shape`` == ``different-op`` when every rank issued the same op from different call
      sites with different sizes (the vocabulary's "same op" once read without the call site).
    """
    if not reported:
        return False
    mech, ranks, others = reported.get("mechanism"), set(reported.get("ranks") or ()), set(reported.get("others") or ())
    swapped = {"skipped-collective": "extra-collective", "extra-collective": "skipped-collective"}
    if swapped.get(label) == mech and culprits and others == set(culprits) and ranks and not ranks & others:
        return True
    ops = reported.get("ops") or []
    one_op = len({o for o, _, _ in ops}) == 1
    sites, shapes = {site for _, site, _ in ops}, {str(shape) for _, _, shape in ops}
    return (label, mech) == ("different-shape", "different-op") and one_op and len(sites) > 1 and len(shapes) > 1


def mechanism_right(expected: set[str] | None, reported: dict | None, culprits: list[int] | None = None) -> bool:
    """The reported mechanism is one of ``expected``, or the same trace fact (``same_trace_fact``) as
    the yaml's single ``mechanism`` label."""
    if not expected or not reported:
        return False
    return reported.get("mechanism") in expected or (
        len(expected) == 1 and same_trace_fact(next(iter(expected)), reported, culprits))


@dataclass
class Case:
    name: str                      # pattern/variant, or healthy_x
    script: Path
    expected: dict
    healthy: bool = False
    reported: str | None = None
    verdict: str | None = None
    culprits: list[int] = field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0
    verify: str | None = None      # the command the report printed, if any
    verified: bool | None = None
    alarm: bool = False
    params: str | None = None      # healthy job run with --check-params: what the parameter check claimed
    error: str | None = None
    skipped: str | None = None     # why it did not run (its environment is missing)
    mechanism: str | None = None   # level 1, as the report names it
    #: The report's mechanism: {"mechanism", "ranks", "others", "ops": [(op, call site, shapes) per rank]}.
    mechanism_detail: dict | None = None
    #: The same run's Flight Recorder dumps analysed alone, and its stacks alone:
    #: {"pattern", "culprits", "mechanism"} (None: the run left none).
    fr: dict | None = None
    stacks: dict | None = None

    def expected_mechanisms(self) -> set[str] | None:
        """The mechanisms that count as right (None: the pattern has none, e.g. a slow job)."""
        if self.expected.get("mechanism"):
            return {self.expected["mechanism"]}
        return MECHANISMS.get(self.expected["pattern"])


def discover(only: set[str] | None, healthy: bool, variants: Path = VARIANTS,
             healthy_dirs: tuple[Path, ...] = (FIXTURES, VARIANTS / "healthy")) -> list[Case]:
    cases = []
    for spec in sorted(variants.glob("*/*.yaml")):
        expected = yaml.safe_load(spec.read_text())
        if only and expected["pattern"] not in only:
            continue
        cases.append(Case(f"{spec.parent.name}/{spec.stem}", spec.with_suffix(".py"), expected))
    if healthy:
        for spec in sorted(p for d in healthy_dirs for p in d.glob("healthy_*/expected.yaml")):
            cases.append(Case(spec.parent.name, spec.parent / "train.py", yaml.safe_load(spec.read_text()), True))
    return cases


def run(cmd: list[str], timeout: float, env: dict[str, str], log: Path) -> tuple[int, str, float]:
    """``healthy_corpus.run`` (the whole process tree killed at ``timeout``), its output kept in ``log``."""
    code, out, seconds = run_job(cmd, env, timeout)
    log.write_text(out)
    return code, out, seconds


def diagnose(case: Case, args: argparse.Namespace, keep: Path) -> Case:
    slug = case.name.replace("/", "__")
    python, recorder = sys.executable, []
    if requires := case.expected.get("requires"):
        python, recorder = str(ENVIRONMENTS[requires]), ["--recorder", "python"]
        if not args.reanalyze and not Path(python).exists():
            case.skipped = f"requires {requires}: no {Path(python).relative_to(REPO)}"
            return case
    run_dir = keep / slug
    nproc = int(case.expected.get("nproc", 2))
    if args.max_nproc and nproc > args.max_nproc and not args.reanalyze:
        case.skipped = f"needs {nproc} ranks, one GPU each: this machine has {args.max_nproc}"
        return case
    job_args = ["--backend", args.backend]
    if not case.healthy:
        job_args += ["--pg-timeout", str(args.pg_timeout)]
    else:
        job_args += [str(a) for a in case.expected.get("args", [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **{k: str(v) for k, v in (case.expected.get("env") or {}).items()})
    silent = case.expected.get("failure") == "silent"  # a job that completes with wrong parameters
    cmd = [python, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--force", *recorder,
           *(["--check-params"] if silent or (case.healthy and args.params_on_healthy) else []),
           "--hang-timeout", str(args.hang_timeout), "--", python, "-m", "torch.distributed.run",
           "--standalone", f"--nproc_per_node={nproc}", str(case.script), *job_args]
    if args.reanalyze:
        out = (keep / f"{slug}.log").read_text() if (keep / f"{slug}.log").exists() else ""
        report = reanalyze(run_dir, write=args.verify)
        if report is None:  # not recorded there (e.g. healthy jobs beside a held-out corpus): not counted
            case.skipped = f"no run directory {run_dir.name} to analyze again"
            return case
    else:
        case.exit_code, out, case.seconds = run(cmd, args.timeout, env, keep / f"{slug}.log")
        try:
            report = json.loads((run_dir / "report.json").read_text())
        except (OSError, ValueError) as e:
            case.error = f"no report.json ({type(e).__name__})"
            return case
    case.alarm = any(a in line for line in out.splitlines() for a in ALARMS)
    case.reported, case.verdict = report.get("pattern"), report.get("verdict")
    if case.expected.get("failure") == "slow":  # slow, not stuck: named by the report's "slow" section
        case.reported = slow_pattern(report, case.expected, case.alarm, case.exit_code)
    case.culprits = report.get("culprit_ranks") or []
    case.mechanism = (report.get("mechanism") or {}).get("mechanism")
    per_rank = ((report.get("divergence") or {}).get("per_rank") or {}).values()
    case.mechanism_detail = {**(report.get("mechanism") or {}), "ops": [
        (v["op"], v.get("call_site"), v.get("shapes")) for v in per_rank if v]}
    if not case.healthy:
        case.fr, case.stacks = flight_recorder_alone(run_dir), stacks_alone(run_dir)
    if silent:  # named by the parameter check (params/check.json), the overwrite's source as culprit
        case.reported, case.culprits = silent_pattern(run_dir, report, case.expected, case.alarm, case.exit_code)
    if case.healthy and args.params_on_healthy:
        case.params = params_claim(run_dir)
    case.verify = report.get("verify_command")
    if case.verify and args.verify and not case.healthy and case.expected.get("fix"):
        code, _, _ = run(shlex.split(case.verify.replace("moedoctor ", f"{python} -m moedoctor ", 1)),
                         args.timeout, env, keep / f"{slug}.verify.log")
        case.verified = code == 0
    return case


def slow_pattern(report: dict, expected: dict, alarm: bool, exit_code: int | None) -> str | None:
    """A ``failure: slow`` variant's pattern counts when the report's ``slow`` section names it with a
    storm at the expected call site and the job was not stopped (no alarm, exit 0; None: reanalyzed);
    otherwise what the report said instead."""
    slow = report.get("slow") or {}
    site = expected.get("call_site") or ""
    named = any(str(s.get("call_site") or "").endswith(site) for s in slow.get("storms") or [])
    if slow.get("pattern") == expected["pattern"] and named and not alarm and exit_code in (0, None):
        return slow["pattern"]
    if alarm or exit_code not in (0, None):
        return report.get("pattern") or "stopped"
    return report.get("pattern") or (f"{slow['pattern']} at another call site" if slow else None)


def silent_pattern(run_dir: Path, report: dict, expected: dict, alarm: bool,
                   exit_code: int | None) -> tuple[str | None, list[int]]:
    """A ``failure: silent`` variant (``overwritten-shards``) counts when ``moedoctor run --check-params``'s
    parameter check names the pattern with an overwrite at the expected call site and the job was not
    stopped; its culprits are the overwrites' source ranks."""
    check = params_check(run_dir)
    if check is None:
        return report.get("pattern") or ("stopped" if alarm or exit_code not in (0, None) else None), []
    site = expected.get("call_site") or ""
    overwrites = [f["overwrite"] for f in check["findings"] if f.get("overwrite")]
    culprits = sorted({o["src"] for o in overwrites if str(o.get("call_site") or "").endswith(site)})
    if alarm or exit_code not in (0, None):
        return report.get("pattern") or "stopped", culprits
    if check["pattern"] == expected["pattern"] and culprits:
        return check["pattern"], culprits
    return check["pattern"] and f"{check['pattern']} at another call site", culprits


def params_check(run_dir: Path) -> dict | None:
    """The parameter check of a run directory, as ``params/check.json`` holds it (None: not run there)."""
    from moedoctor.analysis import load_run
    from moedoctor.analysis.params import check_run_dir, has_params

    if not has_params(run_dir):
        return None
    return check_run_dir(run_dir, {t.rank: t.events for t in load_run(run_dir).traces}).to_json()


def params_claim(run_dir: Path) -> str | None:
    """What the parameter check found in a healthy job's run directory (None: nothing, or no check)."""
    check = params_check(run_dir)
    if check is None or not check["findings"]:
        return None
    kinds = Counter(f["kind"] for f in check["findings"])
    return ", ".join(f"{k} x{n}" for k, n in kinds.items())


def reanalyze(run_dir: Path, write: bool = False) -> dict | None:
    """The report ``moedoctor run`` would write for a kept run directory now (the analysis, then
    whether the fix reaches the job's code), as ``report.json`` holds it; ``write``: replace the
    directory's ``report.json`` with it (``moedoctor verify --run`` reads it)."""
    if not run_dir.is_dir():
        return None
    from moedoctor.analysis import analyze, load_run
    from moedoctor.analysis.report_json import write_json
    from moedoctor.fixes.reach import with_fix_reach
    from moedoctor.render.json_report import report_to_dict
    run = load_run(run_dir)
    result = with_fix_reach(analyze(run), run)
    if write:
        write_json(result, run_dir / "report.json")
    return report_to_dict(result)


def flight_recorder_alone(run_dir: Path) -> dict | None:
    """The run's own Flight Recorder dumps (written at the hang's snapshot) analysed alone."""
    folder = run_dir / "flight_recorder"
    if not folder.is_dir() or not any(folder.glob("fr_rank_*")):
        return None
    from moedoctor.analysis import analyze, load_run

    try:
        report = analyze(load_run(folder))
    except Exception as e:  # a dump the reader refuses: counted as no answer
        return {"pattern": None, "culprits": [], "mechanism": None, "error": type(e).__name__}
    return {"pattern": report.pattern, "culprits": report.culprit_ranks,
            "mechanism": m.mechanism.value if (m := getattr(report, "mechanism", None)) else None,
            "ranks": list(m.ranks) if m else [], "others": list(m.others) if m else []}


def stacks_alone(run_dir: Path) -> dict | None:
    """The run's py-spy stacks read alone (``moedoctor triage``'s reading, no traces)."""
    if not (run_dir / "stacks").is_dir():
        return None
    from moedoctor.analysis import load_run
    from moedoctor.analysis.from_stacks import report_from_stacks

    run = load_run(run_dir)
    if not any(d.error is None for d in run.stacks.values()):
        return None
    report = report_from_stacks(run.stacks, source=str(run_dir), world_size=run.world_size)
    return {"pattern": report.pattern, "culprits": report.culprit_ranks,
            "mechanism": m.mechanism.value if (m := getattr(report, "mechanism", None)) else None,
            "ranks": list(m.ranks) if m else [], "others": list(m.others) if m else []}


def _level_lines(label: str, faults: list[Case], get) -> list[str]:
    """Mechanism, pattern, culprit and confident-wrong counts over the cases ``get`` has an answer for."""
    rows = [(c, get(c)) for c in faults if get(c) is not None]
    if not rows:
        return [f"{label}: none"]
    with_mech = [(c, a) for c, a in rows if c.expected_mechanisms()]
    right = [mechanism_right(c.expected_mechanisms(), a.get("detail") or a, c.expected.get("culprit_ranks"))
             for c, a in with_mech]
    mech_ok = sum(right)
    pattern_ok = sum(a["pattern"] == c.expected["pattern"] for c, a in rows)
    with_culprit = [(c, a) for c, a in rows if c.expected.get("culprit_ranks")]
    culprit_ok = sum(sorted(a["culprits"]) == sorted(c.expected["culprit_ranks"]) for c, a in with_culprit)
    wrong = [c.name + " -> " + str(a["pattern"]) for c, a in rows
             if a["pattern"] not in UNNAMED and a["pattern"] != c.expected["pattern"]]
    lines = [f"{label}: mechanism {mech_ok}/{len(with_mech)}, pattern {pattern_ok}/{len(rows)}, culprit "
             f"{culprit_ok}/{len(with_culprit)}, wrong-confident {len(wrong)}"]
    lines += [f"  wrong-confident: {w}" for w in wrong]
    lines += [f"  mechanism {a['mechanism']} not one of {sorted(c.expected_mechanisms())}: {c.name}"
              for (c, a), ok in zip(with_mech, right) if not ok]
    return lines


def report(cases: list[Case]) -> str:
    faults = [c for c in cases if not c.healthy and not c.skipped]
    healthy = [c for c in cases if c.healthy and not c.skipped]
    lines = []
    truths = sorted({c.expected["pattern"] for c in faults})
    reported = sorted({str(c.reported) for c in faults}, key=lambda p: (p not in truths, p))
    matrix = Counter((c.expected["pattern"], str(c.reported)) for c in faults)
    width = max([len(t) for t in truths] + [8])
    lines.append("confusion matrix (rows: true pattern, columns: reported)")
    lines.append(" " * width + " | " + " | ".join(f"{i:>3}" for i in range(len(reported))))
    for t in truths:
        lines.append(f"{t:<{width}} | " + " | ".join(f"{matrix[(t, r)] or '':>3}" for r in reported))
    lines.append("columns: " + ", ".join(f"{i}={r}" for i, r in enumerate(reported)))
    lines.append("")
    for c in faults:
        ok = c.reported == c.expected["pattern"]
        want = sorted(c.expected.get("culprit_ranks") or [])
        lines.append(f"{'ok ' if ok else 'BAD'} {c.name:<60} {c.seconds:5.0f}s exit {c.exit_code} -> {c.reported} "
                     f"[{c.mechanism}] "
                     f"culprit {c.culprits} (want {want})" + (f" verify {'passed' if c.verified else 'FAILED'}"
                                                              if c.verified is not None else "")
                     + (f" [{c.error}]" if c.error else ""))
    for c in cases:
        if c.skipped:
            lines.append(f"skip {c.name:<59} [{c.skipped}]")
    for c in healthy:
        bad = c.alarm or c.verdict != "healthy" or c.params
        lines.append(f"{'BAD' if bad else 'ok '} {c.name:<60} {c.seconds:5.0f}s "
                     f"exit {c.exit_code} -> {c.verdict}" + (" ALARM" if c.alarm else "")
                     + (f" PARAMETERS: {c.params}" if c.params else ""))
    pattern_ok = sum(c.reported == c.expected["pattern"] for c in faults)
    with_culprit = [c for c in faults if c.expected.get("culprit_ranks")]
    culprit_ok = sum(sorted(c.culprits) == sorted(c.expected["culprit_ranks"]) for c in with_culprit)
    wrong_confident = sum(c.reported not in UNNAMED and c.reported != c.expected["pattern"] for c in faults)
    fixable = [c for c in faults if c.expected.get("fix")]
    verified = sum(bool(c.verified) for c in fixable)
    false_alarms = sum(c.alarm or c.verdict != "healthy" or bool(c.params) for c in healthy)
    by_pattern = defaultdict(list)
    for c in faults:
        by_pattern[c.expected["pattern"]].append(c.reported == c.expected["pattern"])
    lines.append("")
    lines += _level_lines("flight recorder dumps alone", faults, lambda c: c.fr)
    lines += _level_lines("stacks alone", faults, lambda c: c.stacks)
    lines += _level_lines("traces", faults, lambda c: None if c.error else
                          {"pattern": c.reported, "culprits": c.culprits, "mechanism": c.mechanism,
                           "detail": c.mechanism_detail})
    with_mech = [c for c in faults if c.expected_mechanisms()]
    mech_ok = sum(mechanism_right(c.expected_mechanisms(), c.mechanism_detail, c.expected.get("culprit_ranks"))
                  for c in with_mech)
    lines.append("per pattern: " + ", ".join(f"{p} {sum(v)}/{len(v)}" for p, v in sorted(by_pattern.items())))
    lines.append(f"accuracy: mechanism {mech_ok}/{len(with_mech)}, pattern {pattern_ok}/{len(faults)}, culprit {culprit_ok}/{len(with_culprit)}, "
                 f"wrong-confident {wrong_confident}, verify-passed {verified}/{len(fixable)}, "
                 f"false-alarms {false_alarms}/{len(healthy)}")
    return "\n".join(lines)


def _gpus() -> int | None:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in listed.splitlines()) or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--only", default=None, help="comma-separated pattern ids")
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    parser.add_argument("--no-healthy", dest="healthy", action="store_false")
    parser.add_argument("--params-on-healthy", action="store_true",
                        help="run the healthy jobs with --check-params too; a parameter-check finding on one "
                             "counts as a false alarm")
    parser.add_argument("--keep", default=None, help="keep run directories and logs here")
    parser.add_argument("--hang-timeout", type=float, default=15)
    parser.add_argument("--pg-timeout", type=float, default=60)
    parser.add_argument("--timeout", type=float, default=240, help="per job, seconds")
    parser.add_argument("--jobs", type=int, default=1, help="jobs run at once (1 on 2 CPU cores)")
    parser.add_argument("--reverify", action="store_true",
                        help="with --reanalyze: write the new report.json into each run directory and run the "
                             "verify command it prints (the jobs rerun; minutes)")
    parser.add_argument("--max-nproc", type=int, default=None,
                        help="skip jobs of more ranks (NCCL: one GPU per rank; default: the GPUs nvidia-smi lists)")
    parser.add_argument("--variants", type=Path, default=VARIANTS, help="variants folder (<pattern>/<variant>.py|yaml)")
    parser.add_argument("--healthy-dir", type=Path, action="append", default=None,
                        help="a folder of healthy jobs (healthy_*/train.py + expected.yaml); repeatable "
                        "(default: fixtures/ and fixtures/variants/healthy/)")
    parser.add_argument("--reanalyze", type=Path, default=None,
                        help="run nothing: analyze again the run directories a former --keep DIR left")
    args = parser.parse_args()
    if args.reanalyze:
        args.keep, args.verify = args.reanalyze, args.reverify
    if args.backend == "nccl" and args.max_nproc is None:
        args.max_nproc = _gpus()
    cases = discover(set(args.only.split(",")) if args.only else None, args.healthy, args.variants,
                     tuple(args.healthy_dir or (FIXTURES, VARIANTS / "healthy")))
    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="moedoctor-accuracy-"))
    keep.mkdir(parents=True, exist_ok=True)
    print(f"{len(cases)} jobs ({args.backend}); runs and logs in {keep}", file=sys.stderr, flush=True)
    done = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for i, case in enumerate(pool.map(lambda c: diagnose(c, args, keep), cases), 1):
            done.append(case)
            outcome = case.skipped or case.reported or case.verdict
            print(f"[{i}/{len(cases)}] {case.name}: {outcome} ({case.seconds:.0f}s)", file=sys.stderr, flush=True)
    text = report(done)
    (keep / "accuracy.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
