"""After a fault, the record tells the truth (issue 33), on real 2-rank Gloo jobs under ``moedoctor
run`` (tests/jobs/gather_reduce_loop.py: an all_gather then an all_reduce per step):

- ``kill -9`` of the supervisor: ``analyze`` says the run was interrupted (the supervisor's pid, about
  when), names no desync from the ragged trace ends, and exits 2 (no verdict on the job);
- a rank SIGKILLed from outside: the headline leads with that rank and its signal, the launcher's
  SIGTERM to the other follows from it;
- a rank that stops itself (SIGSTOP) right after its all_gather: the other rank is reported waiting
  in the all_reduce after it, the collective it really waits in, even where the stopped rank's trace
  ends before that all_gather (the native recorder writes its records every 2 ms).

On failure the log tails are shown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchrun_util import REPO, job_env, live_processes, run_command, torchrun_command

from moedoctor.errors import EXIT_BAD_INPUT, EXIT_FINDING, EXIT_HANG

JOB = REPO / "tests" / "jobs" / "gather_reduce_loop.py"


def run_cmd(run_dir: Path, *options: str, job_args: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), *options, "--",
            *torchrun_command(JOB, 2, *job_args)]


def survivors(run_dir: Path) -> list[int]:
    mark = f"MOEDOCTOR_RUN_DIR={run_dir.resolve()}".encode()
    return live_processes(lambda proc: mark in (proc / "environ").read_bytes().split(b"\0"))


def job_processes(run_dir: Path) -> dict[int, int]:
    """rank -> pid of this run's rank processes still alive."""
    found = {}
    for pid in survivors(run_dir):
        try:
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"RANK" in env and JOB.name.encode() in cmdline and b"torch.distributed.run" not in cmdline:
            found.setdefault(int(env[b"RANK"]), pid)
    return found


def start(run_dir: Path, out: Path, *options: str, job_args: tuple[str, ...] = ()) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen(run_cmd(run_dir, *options, job_args=job_args), stdout=f, stderr=subprocess.STDOUT,
                                env=job_env(), cwd=REPO, start_new_session=True)


def wait_until(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{log.read_text()[-3000:]}")


def progressing(run_dir: Path) -> bool:
    log = run_dir / "job.log"
    return log.exists() and log.read_text().count("progress") >= 4  # both ranks, past their first second


def cleanup(proc: subprocess.Popen, run_dir: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    for pid in job_processes(run_dir).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def analyze(run_dir: Path, *extra: str):
    return subprocess.run([sys.executable, "-m", "moedoctor", "analyze", str(run_dir), *extra], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**job_env(), "COLUMNS": "200"})


def test_kill_9_of_the_supervisor_is_an_interrupted_run_not_a_desync(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "moedoctor.out"
    # No sleep between collectives: at the stop one rank is usually a collective ahead (ragged ends).
    first = start(run_dir, out, "--hang-timeout", "60", job_args=("--sleep", "0"))
    try:
        wait_until(lambda: progressing(run_dir), 150, "both ranks to make progress", out)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        wait_until(lambda: not survivors(run_dir), 15, "the job to stop after kill -9 of moedoctor", out)
    finally:
        cleanup(first, run_dir)
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "running"  # never finalized

    shown = analyze(run_dir)
    context = f"{shown.stdout}\n{shown.stderr}\n{out.read_text()[-2000:]}"
    assert shown.returncode == EXIT_BAD_INPUT, context  # no verdict on the job
    assert "moedoctor: INTERRUPTED" in shown.stdout, context
    assert f"moedoctor pid {first.pid}" in shown.stdout and "died at about" in shown.stdout, context
    assert "the job was stopped with it" in shown.stdout, context
    assert "no verdict on the job" in shown.stderr and "Traceback" not in shown.stderr, context
    assert "Unknown desync" not in shown.stdout and "Culprit" not in shown.stdout, context

    report = json.loads(analyze(run_dir, "--json").stdout)
    assert report["verdict"] == "interrupted" and report["pattern"] is None, report["summary"]
    assert report["culprit_ranks"] == [] and report["divergence"] is None, report["summary"]
    assert report["source"]["collectives"] > 0  # what the traces show up to the stop


def test_a_rank_killed_from_outside_leads_the_headline(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "moedoctor.out"
    proc = start(run_dir, out, "--hang-timeout", "60")
    try:
        wait_until(lambda: progressing(run_dir), 150, "both ranks to make progress", out)
        ranks = job_processes(run_dir)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)  # someone else kills rank 1
        code = proc.wait(timeout=90)
    finally:
        cleanup(proc, run_dir)
    output = out.read_text()
    assert code not in (0, EXIT_HANG), output[-3000:]
    exits = json.loads((run_dir / "manifest.json").read_text())["ranks"]
    assert (exits["1"]["exit_code"], exits["1"]["first_failure"]) == (-9, True), exits
    assert exits["0"]["first_failure"] is False, exits

    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['evidence'], indent=1)}\n{output[-2000:]}"
    assert report["verdict"] == "crashed", context
    assert report["summary"].startswith("Crashed: rank 1 died (SIGKILL, killed from outside the job)"), context
    assert "rank 0 died" not in report["summary"], context
    assert report["culprit_ranks"] == [1], context
    assert any(e.startswith("rank 1 was killed with SIGKILL (exit -9) from outside the job") for e in report["evidence"])
    if exits["0"]["exit_code"] == -15:  # the launcher's SIGTERM (rank 0 may also end on its own error)
        assert "rank 0 was killed with SIGTERM (exit -15) by the launcher, after rank 1 failed" in report["evidence"]
    assert analyze(run_dir).returncode == EXIT_FINDING


def test_a_stopped_rank_names_the_collective_the_others_really_wait_in(tmp_path):
    run_dir = tmp_path / "run"
    step = 200  # rank 1 stops after its all_gather #401 (2 * step + 1); rank 0 goes on to all_reduce #402
    result = run_command(run_cmd(run_dir, "--hang-timeout", "8", job_args=("--stop-rank", "1", "--stop-step",
                                                                            str(step))), timeout=180)
    assert result.returncode == EXIT_HANG, result.tail()
    assert not survivors(run_dir), result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['evidence'], indent=1)}\n{result.tail(40)}"
    assert report["pattern"] == "rank-stopped" and report["culprit_ranks"] == [1], context
    gather, reduce = 2 * step + 1, 2 * step + 2
    assert f"rank 0 waits in all_reduce #{reduce} of group 0" in report["summary"], context
    assert f"all_gather #{gather}" not in report["summary"], context
    assert any(e.startswith(f"rank 0 waits in all_reduce #{reduce}") for e in report["evidence"]), context
    trace = (run_dir / "traces" / "rank-00001.jsonl").read_text()
    if f'"seq":{gather},' not in trace:  # the stopped rank's last record was not written: said so
        assert f"rank 0 completed all_gather #{gather}, so rank 1 issued it too" in " ".join(report["evidence"])
        assert "which rank 0 completed" in report["culprit_reasoning"], context
