"""The healthy corpus under ``moedoctor run``: which jobs come out healthy, and the false alarms.

Runs every ``fixtures/healthy_*/train.py`` under ``moedoctor run --hang-timeout H`` (rank count from
its ``expected.yaml`` unless ``--nproc``; ``--backend`` is passed to the jobs; a job whose
``expected.yaml`` has ``hang_timeout`` runs with that instead: the ``healthy_busy_*`` jobs stay silent
longer than it, on purpose), then
``moedoctor analyze --json``, and prints one row per job: exit code, verdict, seconds, collectives
recorded (all ranks), the coverage check (recorded counts against the backends' own counters), lag
reports (a rank a step behind: a report, not an alarm) and moedoctor's alarm (its desync finding or
hang) if any.

A job is *healthy* when it exits 0, raises no alarm and the analysis says ``healthy``. A *false
alarm* is any desync/hang alarm (online or from the watchdog: exit 124, a hang in the manifest, an
alarm line in the output) or a non-healthy verdict on a job that exited 0: every job here is
healthy. The last line: ``healthy-corpus: N/M healthy, false-alarms K``.

    python benchmarks/healthy_corpus.py [--backend gloo|nccl] [--nproc N] [--jobs a,b] [--hang-timeout 20]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
ALARMS = ("moedoctor: desync", "moedoctor: hang", "Desync detected while the job ran", "No trace after")
EXIT_HANG = 124


def run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        sys.path.insert(0, str(REPO / "tests"))
        from torchrun_util import _kill_session  # the whole tree, torchrun's workers included

        _kill_session(proc.pid)
        out, _ = proc.communicate()
        code = -9
    return code, out, time.monotonic() - start


def run_job(job: Path, args: argparse.Namespace, root: Path) -> dict:
    expected = yaml.safe_load((job / "expected.yaml").read_text())
    nproc = args.nproc or expected["nproc"]
    run_dir = root / job.name
    job_args = ["--backend", args.backend, *expected.get("args", [])]
    # A busy job (healthy_busy_*) names its own short timeout, so that its busy phase outlasts it.
    timeout = expected.get("hang_timeout", args.hang_timeout)
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", str(timeout),
           "--", sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(job / "train.py"), *job_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({k: str(v) for k, v in (expected.get("env") or {}).items()})
    code, out, seconds = run(cmd, env, args.timeout)
    (root / f"{job.name}.log").write_text(out)

    row = {"job": job.name, "nproc": nproc, "exit": code, "seconds": seconds, "verdict": "-", "collectives": None,
           "traced": None, "alarm": None, "coverage": "-", "lags": sum("moedoctor: lag" in line for line in out.splitlines())}
    alarm_lines = [line.strip() for line in out.splitlines() if any(a in line for a in ALARMS)]
    manifest_path = run_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    hang = manifest.get("hang")
    coverage = manifest.get("coverage")
    row["coverage"] = "-" if not coverage else "ok" if coverage.get("complete") else f"{len(coverage.get('gaps', []))} gaps"
    if hang is not None:
        row["alarm"] = f"{hang.get('trigger', 'hang')}: {hang.get('finding') or 'no progress'}"
    elif alarm_lines:
        row["alarm"] = alarm_lines[0]
    elif code == EXIT_HANG:
        row["alarm"] = "exit 124"
    acode, aout, _ = run([sys.executable, "-m", "moedoctor", "analyze", str(run_dir), "--json"], env, 120)
    try:
        report = json.loads(aout[aout.index("{"):])
        row["verdict"] = report["verdict"]
        row["collectives"] = report["source"]["collectives"]
        row["traced"] = len(report["source"]["traced_ranks"])
        if report["verdict"] != "healthy":
            row["summary"] = report["summary"]
            if "terminate called without an active exception" in out and row["alarm"] is None:
                row["summary"] += (" [a rank aborted at interpreter exit after its work: the PyTorch/Gloo "
                                   "teardown race (\"terminate called without an active exception\"), not moedoctor]")
    except (ValueError, KeyError):
        row["verdict"] = f"analyze exit {acode}"
    row["healthy"] = code == 0 and row["alarm"] is None and row["verdict"] == "healthy"
    row["false_alarm"] = row["alarm"] is not None or (code == 0 and row["verdict"] in ("desync", "stuck"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--nproc", type=int, default=None, help="ranks for every job (default: its expected.yaml)")
    parser.add_argument("--jobs", default=None, help="comma-separated job names (default: every healthy_*)")
    parser.add_argument("--hang-timeout", type=float, default=20)
    parser.add_argument("--timeout", type=float, default=180, help="per job, seconds")
    parser.add_argument("--parallel", type=int, default=1,
                        help="jobs run at once (1 on 2 CPU cores; several GPU jobs can share 2 GPUs)")
    parser.add_argument("--keep", default=None, help="keep run directories and logs here")
    args = parser.parse_args()

    jobs = sorted(p.parent for p in FIXTURES.glob("healthy_*/expected.yaml"))
    if args.jobs:
        wanted = set(args.jobs.split(","))
        jobs = [j for j in jobs if j.name in wanted]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="healthy-corpus-"))
    root.mkdir(parents=True, exist_ok=True)

    header = (f"{'job':<28} {'ranks':>5} {'exit':>5} {'verdict':<9} {'seconds':>8} {'collectives':>11} "
              f"{'coverage':>8} {'lags':>4}  alarm")
    print(header)
    print("-" * len(header))
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
        done = pool.map(lambda job: run_job(job, args, root), jobs)
        for row in done:
            rows.append(row)
            collectives = "-" if row["collectives"] is None else str(row["collectives"])
            print(f"{row['job']:<28} {row['nproc']:>5} {row['exit']:>5} {row['verdict']:<9} {row['seconds']:>8.1f} "
                  f"{collectives:>11} {row['coverage']:>8} {row['lags']:>4}  {row['alarm'] or ''}", flush=True)
            if row.get("summary"):
                print(f"{'':<28}   {row['summary']}", flush=True)
    print(f"(runs and logs in {root})")
    healthy = sum(r["healthy"] for r in rows)
    false_alarms = sum(r["false_alarm"] for r in rows)
    print(f"healthy-corpus: {healthy}/{len(rows)} healthy, false-alarms {false_alarms}")


if __name__ == "__main__":
    main()
