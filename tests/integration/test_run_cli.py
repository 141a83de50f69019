"""``moedoctor run`` for real: 2-rank Gloo jobs under the recorder and the watchdog.

Healthy and failing jobs pass their status through; a hanging job is detected within the hang
timeout, its stacks and GPU state collected, and its whole process tree stopped; Ctrl-C stops it
too. After each run no process of the job may survive.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_util import REPO, JobResult, job_env, live_processes, run_command, torchrun_command

from moedoctor.errors import EXIT_HANG, EXIT_INTERRUPTED
from moedoctor.trace.format import RECORDING, read_statuses

JOBS = REPO / "tests" / "jobs"
NPROC = 2


def moedoctor_run(run_dir: Path, script: str, *options: str, script_args: tuple[str, ...] = (),
                  timeout: float = 40.0) -> JobResult:
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), *options, "--",
           *torchrun_command(JOBS / script, NPROC, *script_args)]
    return run_command(cmd, timeout)


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child: SIGINT to its default, as in a terminal. A suite started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python then installs no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def survivors(run_dir: Path) -> list[int]:
    """Live (non-zombie) processes started for this run: their environment names its run dir."""
    mark = f"MOEDOCTOR_RUN_DIR={run_dir.resolve()}".encode()
    return live_processes(lambda proc: mark in (proc / "environ").read_bytes().split(b"\0"))


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def last_record_time(run_dir: Path) -> float:
    """Wall time of the last collective issued or completed, over every rank's trace."""
    times = []
    for path in (run_dir / "traces").glob("rank-*.jsonl"):
        for line in path.read_text().splitlines()[1:]:
            record = json.loads(line)
            if record["k"] in ("c", "d"):
                times.append(record["t"])
    return max(times)


def main_thread_functions(stack_file: Path) -> list[str]:
    dump = json.loads(stack_file.read_text())
    assert "error" not in dump, dump["error"]
    main = [t for t in dump["threads"] if t["os_thread_id"] == dump["pid"]]
    assert main, f"no main thread in {stack_file}"
    return [f["name"] for f in main[0]["frames"]]


def test_healthy_job_exits_0_with_complete_coverage(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "tiny_healthy.py")
    assert result.returncode == 0, result.tail()
    assert "[rank 0] done" in result.output and "[rank 1] done" in result.output  # passed through
    assert "[rank 1] done" in (run_dir / "job.log").read_text()
    assert sorted(p.name for p in (run_dir / "traces").iterdir()) == [  # each rank's trace and its status
        "rank-00000.jsonl", "rank-00000.status", "rank-00001.jsonl", "rank-00001.status"]
    assert {r: s["state"] for r, s in read_statuses(run_dir / "traces").items()} == {0: RECORDING, 1: RECORDING}
    m = manifest(run_dir)
    assert m["status"] == "finished" and m["world_size"] == NPROC and m["hang"] is None, m
    assert {r: (e["exit_code"], e["source"]) for r, e in m["ranks"].items()} == {
        "0": (0, "launcher"), "1": (0, "launcher")}
    assert m["coverage"] == {"complete": True, "gaps": []}, m["coverage"]
    assert m["env"]["MOEDOCTOR_RUN_DIR"] == str(run_dir.resolve()) and m["end"] > m["start"]
    assert not survivors(run_dir)


def test_failing_rank_status_passes_through(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "tiny_healthy.py", script_args=("--fail-rank", "1"))
    assert result.returncode == 1, result.tail()  # torchrun's own status for a failed worker
    m = manifest(run_dir)
    assert m["nodes"][next(iter(m["nodes"]))]["launcher_exit"] == 1
    assert (m["ranks"]["1"]["exit_code"], m["ranks"]["1"]["source"]) == (3, "torchrun"), m["ranks"]
    assert not survivors(run_dir)


def test_hang_is_detected_diagnosed_and_stopped(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "skip_collective.py", "--hang-timeout", "3")
    assert result.returncode == EXIT_HANG, result.tail()
    assert not survivors(run_dir), f"processes of the job survived:\n{result.tail()}"
    m = manifest(run_dir)
    hang = m["hang"]
    assert m["status"] == "hang" and hang["stopped"], m
    # Detected within the hang timeout plus the watchdog's poll, long before Gloo's 60 s timeout.
    assert 3.0 <= hang["detected_at"] - last_record_time(run_dir) <= 3.0 + 3.0, hang
    by_rank = {r["rank"]: r for r in hang["ranks"]}
    assert by_rank[0]["last"]["op"] == "all_reduce" and by_rank[0]["last"]["seq"] == 3
    assert by_rank[1]["last"]["seq"] == 2  # rank 1 skipped the third all_reduce

    waiting = main_thread_functions(run_dir / "stacks" / "rank-0.json")
    assert waiting[0] in ("all_reduce", "wait") and "main" in waiting, waiting
    assert main_thread_functions(run_dir / "stacks" / "rank-1.json")[0] == "stuck_elsewhere"
    assert by_rank[0]["waiting_in"].startswith("all_reduce") and by_rank[0]["user_frame"].startswith("main")

    (gpu_file,) = (run_dir / "gpu").glob("*.json")
    gpu = json.loads(gpu_file.read_text())
    assert gpu["available"] is False and "NVML" in gpu["reason"]
    assert m["coverage"]["complete"] is True, m["coverage"]  # both ranks answered the snapshot request
    assert {e["source"] for e in m["ranks"].values()} == {"stopped"}
    assert "moedoctor analyze" in result.output and "stuck_elsewhere" in result.output


def test_rank_stuck_before_init_still_gets_its_stack(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "skip_collective.py", "--hang-timeout", "2", "--startup-timeout", "6",
                           script_args=("--before-init",))
    assert result.returncode == EXIT_HANG, result.tail()
    assert not survivors(run_dir), result.tail()
    assert not list((run_dir / "traces").glob("rank-*"))  # no rank got through init_process_group
    assert main_thread_functions(run_dir / "stacks" / "rank-1.json")[0] == "stuck_elsewhere"
    assert "main" in main_thread_functions(run_dir / "stacks" / "rank-0.json")
    ranks = manifest(run_dir)["hang"]["ranks"]
    assert [(r["rank"], r["last"]) for r in ranks] == [(0, None), (1, None)]


def test_ctrl_c_stops_the_whole_job(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "moedoctor.out"
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "60", "--",
           *torchrun_command(JOBS / "skip_collective.py", NPROC)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env(), cwd=REPO,
                                start_new_session=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 30
        job_log = run_dir / "job.log"
        while time.monotonic() < deadline and not (job_log.exists() and "skipping" in job_log.read_text()):
            time.sleep(0.2)
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1.0)  # rank 0 now waits in the all_reduce rank 1 skipped
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert code == EXIT_INTERRUPTED, output[-3000:]
    assert not survivors(run_dir), output[-3000:]
    m = manifest(run_dir)
    assert m["status"] == "interrupted" and m["end"] is not None
    assert {e["source"] for e in m["ranks"].values()} == {"stopped"}


def test_keep_alive_diagnoses_and_leaves_the_job_running(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "moedoctor.out"
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "3",
           "--keep-alive", "--no-stacks", "--", *torchrun_command(JOBS / "skip_collective.py", NPROC)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env(), cwd=REPO,
                                start_new_session=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "Next: moedoctor analyze" not in log.read_text():
            time.sleep(0.2)
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        hang = manifest(run_dir)["hang"]
        assert hang["stopped"] is False
        # --no-stacks: no py-spy, but each rank's process state is still recorded
        dumps = [json.loads(p.read_text()) for p in sorted((run_dir / "stacks").glob("rank-*.json"))]
        assert len(dumps) == NPROC and all("threads" not in d and "--no-stacks" in d["error"] for d in dumps)
        assert all(d["process"]["state"] in ("R", "S") for d in dumps), dumps
        assert len(survivors(run_dir)) >= 3, "the launcher and both ranks should still run"
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == EXIT_INTERRUPTED, log.read_text()[-3000:]
    assert not survivors(run_dir)
    assert manifest(run_dir)["hang"] is not None


@pytest.mark.heavy  # superseded in the suite by test_multinode.py (c10d rendezvous, both layouts)
def test_two_nodes_share_one_run_dir(tmp_path):
    """Two ``moedoctor run`` of one 2-node job (one rank each) on this host, one run directory."""
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    try:
        for node_rank in (0, 1):
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
                        "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                        str(JOBS / "skip_collective.py")]
            logs.append(tmp_path / f"node{node_rank}.out")
            with open(logs[-1], "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "3",
                     "--", *launcher], stdout=out, stderr=subprocess.STDOUT, env=job_env(), cwd=REPO,
                    start_new_session=True))
            if node_rank == 0:
                deadline = time.monotonic() + 10
                while not (run_dir / "manifest.json").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        codes = [p.wait(timeout=40) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs = "\n".join(log.read_text()[-2000:] for log in logs)
    assert codes == [EXIT_HANG, EXIT_HANG], outputs
    assert "joined the run" in logs[1].read_text()
    assert not survivors(run_dir)
    m = manifest(run_dir)
    assert len(m["nodes"]) == 2 and m["status"] == "hang" and sorted(m["ranks"]) == ["0", "1"], m
    assert m["coverage"]["complete"] is True
    assert sorted(p.name for p in (run_dir / "stacks").iterdir()) == ["rank-0.json", "rank-1.json"]
    assert {r["rank"]: r["waiting_in"].split()[0] for r in m["hang"]["ranks"]} == {
        0: "all_reduce", 1: "stuck_elsewhere"}


def test_a_rank_slow_to_import_torch_is_not_a_hang(tmp_path):
    """Rank 0 imports torch 6 s after rank 1 (hang timeout 2 s): the start-up allowance covers it, so
    no early diagnosis is recorded, and the healthy job's report says healthy."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "slow_import.py", "--hang-timeout", "2", timeout=90)
    assert result.returncode == 0, result.tail()
    assert manifest(run_dir)["hang"] is None, result.tail()
    assert json.loads((run_dir / "report.json").read_text())["verdict"] == "healthy", result.tail()
