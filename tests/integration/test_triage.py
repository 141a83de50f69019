"""``moedoctor triage --pid`` on real hanging jobs started with plain ``torchrun`` (Gloo, 2 ranks,
``--pg-timeout 600`` so they stay stuck): it names the stuck ranks and the pattern the evidence
allows, and the job is still running afterwards (a rank that stopped itself stays stopped). One more job runs under ``moedoctor run
--keep-alive``, where the traces give triage the full pattern."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_util import FIXTURES, REPO, job_env, torchrun_command

from moedoctor.runner import procs

#: Seconds a job may take to reach its hang (2 ranks sharing 2 busy cores).
STUCK_WITHIN = 75.0


class Job:
    def __init__(self, cmd: list[str], log: Path):
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=job_env(), cwd=REPO,
                                     start_new_session=True)

    def ranks(self) -> dict[int, int]:
        return {r: p.pid for r, p in procs.rank_processes(procs.job_processes(self.proc.pid)).items()}

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        # torchrun's workers have sessions of their own: kill each process of the job.
        procs.stop_processes(lambda: procs.job_processes(self.proc.pid), grace=0.5)
        self.proc.wait(timeout=10)


def triage_json(pid: int, out: Path) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "moedoctor", "triage", "--pid", str(pid), "--out", str(out),
                           "--json"], capture_output=True, text=True, timeout=90, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def triage_when(job: Job, tmp_path: Path, ready, within: float = STUCK_WITHIN) -> tuple[int, dict]:
    """Triage the job until ``ready(doc)`` (the hang reached), or fail with the job's log tail."""
    deadline = time.monotonic() + within
    attempt = 0
    doc: dict = {}
    while time.monotonic() < deadline:
        time.sleep(4)
        assert job.proc.poll() is None, f"the job ended ({job.proc.returncode}):\n{job.tail()}"
        if len(job.ranks()) < 2:
            continue
        attempt += 1
        code, doc = triage_json(job.proc.pid, tmp_path / f"triage-{attempt}")
        if ready(doc):
            return code, doc
    pytest.fail(f"not stuck as expected after {within:.0f} s; last triage: {doc.get('summary')}\n{job.tail()}")


def plain_job(name: str, tmp_path: Path) -> Job:
    return Job(torchrun_command(FIXTURES / name / "train.py", 2, "--pg-timeout", "600"), tmp_path / "job.log")


def assert_still_running(job: Job, ranks_before: dict[int, int]) -> None:
    assert job.proc.poll() is None
    for rank, pid in ranks_before.items():
        assert procs.is_alive(pid), f"rank {rank} (pid {pid}) is gone after triage"
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state not in ("T", "t"), f"rank {rank} left stopped ({state})"


def both_in_collectives(doc: dict) -> bool:
    return all(doc["ranks"].get(str(r), {}).get("in_collective") for r in (0, 1))


#: Each desync fixture, and a call site its hang shows (a single snapshot of a healthy step can
#: catch the ranks in different collectives for a moment: wait for the real hang).
DESYNCS = {"skipped_optimizer_step": "sharded_optim.py:45", "inflight_metric_allreduce": "train.py:35",
           "uneven_dtensor_allgather": "checkpoint.py:83"}


@pytest.mark.parametrize("name", sorted(DESYNCS))
def test_triage_desync_fixture_from_stacks(name, tmp_path):
    job = plain_job(name, tmp_path)
    try:
        code, doc = triage_when(job, tmp_path, lambda d: d["verdict"] == "desync" and DESYNCS[name] in d["summary"])
        ranks = job.ranks()
        assert code == 1
        assert doc["triage"]["evidence"] == "stacks"
        assert sorted(doc["triage"]["ranks"]) == ["0", "1"]
        assert both_in_collectives(doc), doc["ranks"]
        assert "ranks wait in different collectives" in doc["summary"]
        assert "rank 0 in" in doc["summary"] and "rank 1 in" in doc["summary"]
        time.sleep(1)
        assert_still_running(job, ranks)
    finally:
        job.stop()


def test_triage_straggler_names_the_odd_rank(tmp_path):
    job = plain_job("straggler", tmp_path)
    try:
        code, doc = triage_when(job, tmp_path, lambda d: d["pattern"] == "straggler" and "_read_shard" in d["summary"])
        ranks = job.ranks()
        assert code == 1 and doc["verdict"] == "stuck"
        assert doc["culprit_ranks"] == [1]
        assert "_read_shard" in doc["summary"] and "rank 0 waits in all_reduce" in doc["summary"]
        assert doc["ranks"]["0"]["in_collective"] is True and doc["ranks"]["1"]["in_collective"] is False
        assert doc["triage"]["gpu"]["available"] in (True, False)
        time.sleep(1)
        assert_still_running(job, ranks)
    finally:
        job.stop()


def test_triage_rank0_saving_while_rank1_waits_is_slow_not_a_straggler(tmp_path):
    """Busy is not stuck: rank 0 writes a checkpoint (progressing: CPU, bytes written) while rank 1
    waits at the barrier. Triage reads both ranks twice over its progress window and says slow,
    naming rank 0's function, not "straggler"."""
    job = Job(torchrun_command(FIXTURES / "healthy_busy_rank0_save_barrier" / "train.py", 2, "--busy-seconds", "120",
                               "--pg-timeout", "600"), tmp_path / "job.log")
    try:
        # ready once rank 1 is at the barrier (under load a first reading can still catch both in training)
        code, doc = triage_when(job, tmp_path, lambda d: d["ranks"].get("1", {}).get("in_collective") is True
                                and "rank 1 waits in barrier" in (d.get("summary") or ""))
        ranks = job.ranks()
        assert doc["verdict"] == "slow" and code == 0, (doc["summary"], doc["triage"]["notes"])
        assert doc["pattern"] is None and doc["culprit_ranks"] == []
        assert "rank 0 working in save_checkpoints" in doc["summary"] and "progressing" in doc["summary"]
        assert "rank 1 waits in barrier" in doc["summary"]
        assert_still_running(job, ranks)
    finally:
        job.stop()


def test_triage_job_under_moedoctor_run_gives_the_full_pattern(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "600",
           "--keep-alive", "--",
           *torchrun_command(FIXTURES / "inflight_metric_allreduce" / "train.py", 2, "--pg-timeout", "600")]
    job = Job(cmd, tmp_path / "job.log")
    try:
        code, doc = triage_when(job, tmp_path, lambda d: d["triage"]["evidence"] == "traces"
                                and d["pattern"] == "inflight-metric-allreduce")
        ranks = job.ranks()
        assert code == 1 and doc["verdict"] == "desync"
        assert doc["culprit_ranks"] == [1]
        assert doc["triage"]["run_dir"] == str(run_dir)
        assert str(run_dir) in doc["verify_command"]
        assert (run_dir / "control" / "snapshot").exists()  # the recorders were asked for a snapshot
        time.sleep(1)
        assert_still_running(job, ranks)
    finally:
        job.stop()


def test_triage_hardware_like_names_the_stopped_rank_and_leaves_it_stopped(tmp_path):
    job = plain_job("hardware_like", tmp_path)  # rank 1 SIGSTOPs itself inside the all_reduce
    try:
        # Rank 0 joins the all_reduce 2 s after rank 1 froze in it: wait for both to be in it.
        code, doc = triage_when(job, tmp_path, lambda d: d["pattern"] == "rank-stopped" and both_in_collectives(d))
        ranks = job.ranks()
        assert code == 1 and doc["verdict"] == "stuck", doc["summary"]
        assert doc["culprit_ranks"] == [1] and "rank 1's process is stopped (state T" in doc["summary"]
        assert doc["suggestion"]["call_site"] is None and "permission" not in json.dumps(doc).lower()
        assert both_in_collectives(doc), doc["ranks"]
        states = {r: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for r, pid in ranks.items()}
        assert states[1] in ("T", "t"), states  # read without attaching: not woken up
        assert job.proc.poll() is None and all(procs.is_alive(pid) for pid in ranks.values())
    finally:
        job.stop()
