"""How fast ``moedoctor run`` detects a desync online, and what the detection costs the supervisor.

For each desync fixture (2 Gloo ranks, ``--hang-timeout 120``, ``--pg-timeout 60``), run it under
``moedoctor run`` and print:

- ``issued``: the mismatched collective's issue time, the later of the two sides (from the traces, at
  the report's divergence);
- ``detected``: the detector's latency as the manifest records it (``hang.detection_latency_s``);
- ``alert``: when moedoctor printed its one-line ``moedoctor: desync: ...`` alert (read here, as printed);
- ``report``: when the full report began (``Desync detected while the job ran``), after the stacks,
  GPU snapshot, coverage wait and stopping the job;
- ``end``: when moedoctor exited; all relative to ``issued``.

Then the supervisor's CPU time per 10,000 collective records: the trace follower alone, and with the
detector listening (synthetic 2-rank traces, read in 1,000-record polls).

    python benchmarks/online_detection.py [--repeat 3] [--fixtures a,b] [--no-cost]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

FIXTURES = ["skipped_optimizer_step", "inflight_metric_allreduce", "uneven_dtensor_allgather", "inactive_experts"]


def run_fixture(name: str, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "120", "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "fixtures" / name / "train.py"), "--pg-timeout", "60"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200")
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)
    seen: dict[str, float] = {}

    def read() -> None:
        for line in proc.stdout:
            text = line.decode(errors="replace")
            for key, marker in (("alert", "moedoctor: desync:"), ("report", "Desync detected while the job ran")):
                if marker in text and key not in seen:
                    seen[key] = time.time()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    end = time.time()
    reader.join(timeout=5)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    hang = manifest.get("hang") or {}
    row = {"fixture": name, "exit": code, "trigger": hang.get("trigger"), "latency": hang.get("detection_latency_s"),
           "wall": end - start}
    issued = issue_time(run_dir)
    if issued is not None:
        row["issued"] = issued
        row.update({k: v - issued for k, v in seen.items()})
        row["end"] = end - issued
    return row


def issue_time(run_dir: Path) -> float | None:
    """The later issue time of the report's diverging collective, from the traces."""
    from moedoctor.trace.reader import read_trace

    try:
        div = json.loads((run_dir / "report.json").read_text())["divergence"]
    except (OSError, ValueError, KeyError):
        return None
    if not div:
        return None
    group, seq = div["group"]["name"], div["seq"]
    times = [e.time for p in sorted((run_dir / "traces").glob("rank-*.jsonl")) for e in read_trace(p).events
             if e.group.name == group and e.seq == seq and not e.is_p2p]
    return max(times) if len(times) >= 2 else None


def supervisor_cost(records: int = 100_000, batch: int = 1000) -> dict:
    """CPU seconds per 10k collective records: following the traces, with and without the detector."""
    from event_factory import encode_trace, ranks

    from moedoctor.runner.online import DesyncDetector
    from moedoctor.runner.progress import ProgressTracker

    builders = ranks(2)
    groups = [None]
    for i in range(records // 2):
        for b in builders:
            b.coll("all_reduce" if i % 3 else "all_gather", (16,), step=i // 25, group=groups[0])
    data = {b.rank: encode_trace(b).splitlines(keepends=True) for b in builders}
    out = {}
    for label, with_detector in (("follow", False), ("follow+detect", True)):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            files = {r: open(folder / f"rank-{r:05d}.jsonl", "wb") for r in data}
            det = DesyncDetector() if with_detector else None
            tracker = ProgressTracker(folder, listener=det.feed if det else None)
            cpu = 0.0
            # Header and definitions first, then the records in polls of ``batch`` lines per rank.
            lines = {r: ls for r, ls in data.items()}
            pos = dict.fromkeys(lines, 0)
            while any(pos[r] < len(lines[r]) for r in lines):
                for r, f in files.items():
                    f.writelines(lines[r][pos[r]:pos[r] + batch])
                    f.flush()
                    pos[r] += batch
                t0 = time.process_time()
                tracker.poll()
                cpu += time.process_time() - t0
            for f in files.values():
                f.close()
            assert det is None or (det.desync is None and det.records == records), det
            out[label] = cpu / (records / 10_000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fixtures", default=",".join(FIXTURES))
    parser.add_argument("--no-cost", action="store_true")
    args = parser.parse_args()
    rows = []
    for name in args.fixtures.split(","):
        for i in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="online-bench-") as tmp:
                row = run_fixture(name, Path(tmp) / "run")
            rows.append(row)
            fmt = lambda k: f"{row[k]:.2f}s" if isinstance(row.get(k), float) else "-"  # noqa: E731
            print(f"{name} #{i + 1}: exit {row['exit']} trigger {row['trigger']} detected {fmt('latency')} "
                  f"alert {fmt('alert')} report {fmt('report')} end {fmt('end')} (run {row['wall']:.1f}s)", flush=True)
    print("\n| fixture | runs | trigger | detected (median, max) | alert printed | report printed | moedoctor exits |")
    print("|---|---|---|---|---|---|---|")
    for name in args.fixtures.split(","):
        mine = [r for r in rows if r["fixture"] == name]
        triggers = "/".join(sorted({str(r["trigger"]) for r in mine}))

        def col(key: str) -> str:
            vals = [r[key] for r in mine if isinstance(r.get(key), float)]
            if not vals:
                return "-"
            return f"{statistics.median(vals):.2f} s, {max(vals):.2f} s"

        print(f"| {name} | {len(mine)} | {triggers} | {col('latency')} | {col('alert')} | {col('report')} | {col('end')} |")
    if not args.no_cost:
        cost = supervisor_cost()
        print("\nsupervisor CPU per 10k records: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in cost.items()))


if __name__ == "__main__":
    main()
